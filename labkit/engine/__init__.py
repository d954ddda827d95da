"""The Pulumi engine and its providers as the lab carries them out: the engine's order and
pulumi-command over SSH (executor), the kreuzwerker docker provider (dockerprovider, dockeragent),
and every departure from a host in one place (substitutions)."""
