"""The endpoint's nginx (the Debian binary) on loopback in front of a stand-in model server,
with a key and TLS from a throwaway CA, for tests that need no namespace."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

from labkit.cluster import probes, tlsca
from labkit.models import modelserver
from qwen_cluster.render import nginx
from tests.helpers.configs import TEST_API_KEY
from tests.helpers.standin_server import free_port, serving
from tests.helpers.wait import wait_until


@contextlib.contextmanager
def locked_nginx(
    directory: Path,
    router_at: tuple[str, int] | None = None,
    disaggregated: bool = False,
) -> Iterator[tuple[int, probes.ClientAccess, modelserver.ModelServer]]:
    """Yields (nginx's port, a client holding the key and the CA, the stand-in). `router_at`: a
    router in front (nginx.router_server), the stand-in its backup; `disaggregated`: as
    serving.mode disaggregated renders it."""
    with serving(modelserver.Settings(node="loopback")) as (backend, server):
        port = free_port()
        for sub in ("logs", "state"):
            (directory / sub).mkdir()
        authority = tlsca.ensure(directory / "tls", "127.0.0.1")
        (directory / nginx.TLS_CERTIFICATE_FILE).write_text(authority.certificate.read_text())
        (directory / nginx.TLS_PRIVATE_KEY_FILE).write_text(authority.private_key.read_text())
        (directory / nginx.KEYS_FILE).write_text(nginx.keys_conf([TEST_API_KEY]))
        conf = nginx.render(
            [("127.0.0.1", backend)],
            listen_port=port,
            idle_timeout_seconds=60,
            runtime_dir="state",
            log_dir="logs",
            pid_file="nginx.pid",
            user=None,
            api_keys=True,
            tls=True,
            secrets_dir=str(directory),
            router_at=router_at,
            disaggregated=disaggregated,
        ).replace(f"listen {port} ssl;", f"listen 127.0.0.1:{port} ssl;")
        (directory / "nginx.conf").write_text(conf)
        process = subprocess.Popen(
            ["nginx", "-p", f"{directory}/", "-c", str(directory / "nginx.conf"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        access = probes.ClientAccess(api_key=TEST_API_KEY, ca_file=str(authority.ca_certificate))
        try:
            wait_until(
                lambda: probes.tcp_connect("127.0.0.1", port, timeout=0.2).open,
                what="nginx listening on loopback",
                timeout=10,
            )
            yield port, access, server
        finally:
            process.terminate()
            process.wait(timeout=10)
