"""NodeProxy: the endpoint's secrets as SecureString parameters, the proxy's SSM document, the
nodes' permission to read those parameters, and (`front`) one association per replica head that
runs the proxy (qwen_cluster/render/proxy.py says what a run does and why a proxy on the node).

Day 2, from the provider's source (hashicorp/terraform-provider-aws
internal/service/ssm/parameter.go): `name` is ForceNew; `value` updates in place (PutParameter
with Overwrite) and makes `version` computed, so a changed key is a new version; `tier` forces a
new parameter only from Advanced down to Standard (Intelligent-Tiering moves up by itself and its
diff is suppressed). The association carries the versions in its parameters and replaces on any
change of them (association.go waits for its run on create only), so `pulumi up` returns once
every proxy has reloaded with the new keys. No model-server association depends on these inputs:
vLLM never restarts for a key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components.aws.documents import command_document
from qwen_cluster.config import ClusterConfig, EndpointSecrets
from qwen_cluster.render import nginx, proxy

from .serving import PARAMETER_PREFIX


@dataclass
class NodeProxyArgs:
    cluster: ClusterConfig
    secrets: EndpointSecrets
    role_name: pulumi.Input[str]
    tags: dict[str, str]


class NodeProxy(pulumi.ComponentResource):
    def __init__(self, name: str, args: NodeProxyArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:aws:NodeProxy", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self._name, self._args = name, args
        prefix = f"{PARAMETER_PREFIX.format(stack=pulumi.get_stack())}endpoint"
        secrets = args.secrets
        values = {
            "api-keys": secrets.api_keys.apply(nginx.keys_conf) if secrets.api_keys is not None else None,
            "tls-certificate": secrets.tls_certificate,
            "tls-private-key": secrets.tls_private_key,
        }
        self.parameters: dict[str, aws.ssm.Parameter] = {
            role: aws.ssm.Parameter(
                f"{name}-{role}",
                name=f"{prefix}/{role}",
                type="SecureString",  # encrypted with the account's aws/ssm key
                value=pulumi.Output.secret(value),
                # A certificate chain can pass the standard tier's 4 KB; this tier moves up alone.
                tier="Intelligent-Tiering",
                tags={**args.tags, "Name": f"{name}-{role}"},
                opts=child,
            )
            for role, value in values.items()
            if value is not None
        }
        self.document = command_document(f"{name}-document", proxy.document(), args.tags, child)
        self.read_policy = None
        if self.parameters:
            arns = [parameter.arn for parameter in self.parameters.values()]
            # GetParameter on exactly these; decryption with the AWS managed key aws/ssm needs no
            # kms grant of the role's own (the key's policy allows its use through SSM).
            self.read_policy = aws.iam.RolePolicy(
                f"{name}-read",
                role=args.role_name,
                policy=pulumi.Output.all(*arns).apply(
                    lambda resolved: json.dumps(
                        {
                            "Version": "2012-10-17",
                            "Statement": [
                                {"Effect": "Allow", "Action": "ssm:GetParameter", "Resource": list(resolved)}
                            ],
                        }
                    )
                ),
                opts=child,
            )
        self.register_outputs({"document": self.document.name})

    def _parameter_inputs(self) -> dict[str, pulumi.Input[str]]:
        names = {role: parameter.arn for role, parameter in self.parameters.items()}
        versions = [parameter.version for parameter in self.parameters.values()]
        return {
            "keys_parameter": names.get("api-keys", ""),
            "certificate_parameter": names.get("tls-certificate", ""),
            "private_key_parameter": names.get("tls-private-key", ""),
            "secrets_version": pulumi.Output.all(*versions).apply(
                lambda resolved: ",".join(str(int(v)) for v in resolved if v is not None)
            )
            if versions
            else "",
        }

    def front(self, node_name: str, instance_id: pulumi.Input[str]) -> list[pulumi.Resource]:
        """The proxy on one replica head, started before its model server's run (which waits for
        the NLB to call the node healthy, through this proxy). Returns what that run waits for."""
        depends = [self.read_policy] if self.read_policy is not None else []
        association = aws.ssm.Association(
            f"{self._name}-{node_name}",
            name=self.document.name,
            targets=[{"key": "InstanceIds", "values": [instance_id]}],
            parameters=proxy.parameters(self._args.cluster, node_name, **self._parameter_inputs()),
            max_concurrency="1",
            max_errors="0",
            wait_for_success_timeout_seconds=proxy.RUN_TIMEOUT_SECONDS,
            opts=pulumi.ResourceOptions(
                parent=self,
                # Waited for on create only (association.go): every change replaces.
                replace_on_changes=["parameters", "targets"],
                depends_on=depends,
            ),
        )
        return [association]
