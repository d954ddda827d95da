"""A certificate chain and its key judged as a TLS server would load them (the pure check behind
`loadBalancer.tls`): matched, in date, in order, naming the server."""

from __future__ import annotations

from datetime import timedelta

from qwen_cluster.config.x509check import EXPIRY_ADVISORY_DAYS, certificate_problems
from tests.helpers.certificates import NOW, chain, issue


def problems(leaf, *rest, key=None, names=()):
    text = "".join(item.pem for item in (leaf, *rest))
    return certificate_problems(text, key if key is not None else leaf.key_pem, now=NOW, names=names)


def test_a_server_certificate_with_its_intermediate_and_key_passes():
    _, intermediate, leaf = chain()
    assert problems(leaf, intermediate, names=("endpoint.example.com",)) == ([], [])


def test_a_key_that_is_not_the_server_certificates_is_refused():
    _, intermediate, leaf = chain()
    other = issue("someone else")
    (error,), _ = problems(leaf, intermediate, key=other.key_pem)
    assert error.startswith("privateKey does not match the server certificate, certificate 1 (CN=endpoint")


def test_an_expired_certificate_is_refused_with_its_date():
    leaf = issue("old", not_before=NOW - timedelta(days=400), not_after=NOW - timedelta(days=3))
    (error,), _ = problems(leaf)
    ended = NOW - timedelta(days=3)
    assert error == f"certificate: certificate 1 (CN=old) expired on {ended:%Y-%m-%d %H:%M} UTC"


def test_a_certificate_not_yet_valid_is_refused():
    leaf = issue("early", not_before=NOW + timedelta(days=2))
    (error,), _ = problems(leaf)
    assert "certificate 1 (CN=early) is not valid before" in error


def test_a_reversed_chain_is_refused_as_reversed():
    root, intermediate, leaf = chain()
    errors, _ = problems(root, intermediate, leaf, key=leaf.key_pem)
    assert errors == [
        "privateKey does not match the server certificate, certificate 1 (CN=test root CA); it is the key "
        "of certificate 3 (CN=endpoint.example.com): the server certificate comes first in the chain",
        "certificate is in reverse order: certificate 3 (CN=endpoint.example.com) is the server's; the "
        "server certificate comes first, then the certificate that signed it, and so on",
    ]


def test_an_issuer_that_did_not_sign_the_certificate_before_it_is_refused():
    _, _, leaf = chain()
    stranger = issue("stranger CA", ca=True)
    errors, _ = problems(leaf, stranger)
    assert errors == [
        "certificate is out of order: certificate 2 (CN=stranger CA) did not sign certificate 1 "
        "(CN=endpoint.example.com); each certificate must be followed by its issuer"
    ]


def test_a_certificate_close_to_its_end_is_a_warning_only():
    leaf = issue("soon", not_after=NOW + timedelta(days=EXPIRY_ADVISORY_DAYS - 1, hours=1))
    errors, (warning,) = problems(leaf)
    assert errors == [] and warning.startswith("certificate: certificate 1 (CN=soon) expires on")
    assert f"in {EXPIRY_ADVISORY_DAYS - 1} days" in warning


def test_names_must_be_covered_by_the_subject_alternative_name():
    leaf = issue("lb", names=("*.example.com", "192.168.1.100"))
    assert problems(leaf, names=("api.example.com", "192.168.1.100")) == ([], [])
    (error,), _ = problems(leaf, names=("a.b.example.com", "192.168.1.101"))
    assert "does not name a.b.example.com, 192.168.1.101" in error  # a wildcard is one label


def test_garbage_between_the_markers_is_refused_without_showing_the_key():
    errors, _ = certificate_problems(
        "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n",
        "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWJ5dGVz\n-----END PRIVATE KEY-----\n",
        now=NOW,
    )
    assert errors[0].startswith("certificate is not a readable PEM certificate chain")
    assert errors[1] == "privateKey is not a readable PEM private key (the value is not shown)"
    assert "c2VjcmV0LWJ5dGVz" not in " ".join(errors)
