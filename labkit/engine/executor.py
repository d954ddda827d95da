"""The lab's engine: what the program registered, executed in network namespaces.

`render` runs the program under Pulumi's mocks (tooling/offline.py) with the lab's stack
substitutions. `Executor.apply(old, new)` then does what `pulumi up` would do between those
two renders, resource by resource:

- a `command:remote:Command` runs its `create` (or `update`, else `create` again, on an
  in-place update; the old state's `delete` on a delete) over SSH on its `connection.host`, as
  `connection.user`, with the host key `connection.hostKey` pins (labkit/hosts/sshd.py: the node's
  own sshd, the OpenSSH client from the admin vantage; pulumi-command
  provider/pkg/provider/remote/commandController.go: Update runs `update` if set, else
  `create`; Delete runs the stored state's `delete`);
- a `docker:index/container:Container` and a `docker:index/remoteImage:RemoteImage` are
  carried out on the real dockerd of the node their provider's `ssh://` host names, as the
  provider would (labkit/engine/dockerprovider.py, citing kreuzwerker/terraform-provider-docker):
  over that provider's ssh, as its user and with its `sshOpts` (the program's pinned host key),
  first `docker version` (as pulumi-docker dials `docker system dial-stdio`), then one session
  per step; a container is deleted by the id the state holds, with its `destroyGraceSeconds`;
- a container whose create failed after docker created it (it would not start) stays in the
  state with its id and `initErrors`, as the engine records a partial create
  (dockerprovider.py cites where); the next apply updates it (the engine's `#initerror` diff)
  or, when its inputs changed, replaces it: deleted by id, so no name conflict is left behind;
- what changed, and whether a change updates in place or replaces (create-before-delete, or
  delete-before-replace), is decided by `tooling/changes/` (`diff`), the project's one
  table of replacement rules.

Order is the engine's: a resource's step starts when every resource it depends on (the
dependency graph of `Render.dependencies()`, plus its provider) has finished; independent
steps run in parallel. A delete-before-replace deletes the old resource just before the
new one is created; create-before-delete replacements and removed resources are deleted at
the end, dependents first. The first failure stops new steps from starting (in-flight ones
finish), as `pulumi up` does without --continue-on-error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from labkit.engine import dockerprovider, substitutions
from labkit.hosts import sshd
from labkit.images import standins
from qwen_cluster.render.shell import MAX_ARG_STRLEN
from tooling import offline
from tooling.offline import RecordedResource, Render

COMMAND = "command:remote:Command"
CONTAINER = "docker:index/container:Container"
IMAGE = "docker:index/remoteImage:RemoteImage"
PROVIDER_PREFIX = "pulumi:providers:"
SECRET_SIG = "4dabf18193072939515e22adb298388d"  # Pulumi's marker of a secret value
COMMAND_TIMEOUT = 900.0
# An image pull or a container step over SSH: bounded by what the daemon is asked to wait for
# (a stop's grace) plus this margin, so a hung daemon fails the step instead of the apply.
DOCKER_STEP_MARGIN = 120.0


@dataclass
class StepResult:
    node: str
    step: str
    ok: bool
    detail: str = ""
    resource: str = ""
    op: str = ""  # create | update | delete | same | fixture
    started: float = 0.0  # seconds since the apply started
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ExecutorError(RuntimeError):
    pass


# ---------------------------------------------------------------- renders and state


def render(
    stack_config: dict[str, Any],
    stack: str,
    clock_scale: float,
    ssh: substitutions.SshIdentity | None = None,
    endpoint: Any = None,
) -> tuple[Render, list[str]]:
    """The program under mocks, with the lab's stack substitutions; fails naming the error."""
    config, made = substitutions.stack_config(stack_config, clock_scale, ssh, endpoint)
    result = offline.render(config, stack)
    if result.error:
        raise ExecutorError(f"the program failed under mocks: {result.error}")
    stored = as_stored(result)
    paced = False
    for resource in stored.custom_resources:
        if resource.type == COMMAND:
            for key in ("create", "update", "delete"):
                text = resource.inputs.get(key)
                if isinstance(text, str):
                    lab_text = substitutions.script_clock(text, clock_scale)
                    paced = paced or lab_text != text
                    resource.inputs[key] = lab_text
    return stored, made + ([substitutions.SCRIPT_CLOCK_NOTE] if paced else [])


def plain(value: Any) -> Any:
    """Inputs as the lab reads them: secrets unwrapped."""
    if isinstance(value, dict):
        if SECRET_SIG in value and "value" in value:
            return plain(value["value"])
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value


def render_to_json(rendered: Render) -> dict[str, Any]:
    resources = []
    for resource in rendered.resources:
        entry = asdict(resource)
        # The lab's renders hold the offline placeholder key, never a real one; drop it anyway.
        connection = plain(entry["inputs"]).get("connection")
        if isinstance(connection, dict):
            connection.pop("privateKey", None)
            entry["inputs"] = {**plain(entry["inputs"]), "connection": connection}
            entry["outputs"] = {}
        resources.append(entry)
    return {"stack": rendered.stack, "resources": resources, "outputs": rendered.outputs}


def as_stored(rendered: Render) -> Render:
    """A render as the lab's state keeps it (secrets unwrapped, no key), so that a fresh
    render and a stored one compare like for like."""
    return render_from_json(json.loads(json.dumps(render_to_json(rendered), default=str)))


def render_from_json(document: dict[str, Any]) -> Render:
    return Render(
        document["stack"],
        [RecordedResource(**entry) for entry in document["resources"]],
        document.get("outputs", {}),
        [],
    )


@dataclass
class State:
    """What the last apply left: the config it applied, the render of what exists, and each
    command's last output (pulumi-command keeps stdout/stderr in its state)."""

    config: dict[str, Any]
    render: Render
    outputs: dict[str, dict[str, str]]


def save_state(
    path: Path, stack_config: dict[str, Any], rendered: Render, outputs: dict[str, dict[str, str]]
) -> None:
    document = {"config": stack_config, "render": render_to_json(rendered), "outputs": outputs}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(document, default=str))
    tmp.replace(path)


def load_state(path: Path) -> State | None:
    if not path.exists():
        return None
    document = json.loads(path.read_text())
    return State(document["config"], render_from_json(document["render"]), document.get("outputs", {}))


# ---------------------------------------------------------------- the graph


def graph(rendered: Render) -> dict[str, set[str]]:
    """Who waits for whom: Render.dependencies() plus each resource's provider (the engine
    creates a provider before any resource that uses it)."""
    deps = rendered.dependencies()
    names = set(deps)
    for resource in rendered.custom_resources:
        if resource.provider:
            provider = resource.provider.split("::")[-2] if "::" in resource.provider else ""
            if provider in names and provider != resource.name:
                deps[resource.name].add(provider)
    return deps


def topological(deps: dict[str, set[str]], order: list[str]) -> list[str]:
    """`order` (registration order) rearranged so every resource follows what it waits for."""
    done: set[str] = set()
    result: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in done:
            return
        if name in path:
            raise ExecutorError(f"dependency cycle: {' -> '.join((*path, name))}")
        for dependency in sorted(deps.get(name, ())):
            visit(dependency, (*path, name))
        done.add(name)
        result.append(name)

    for name in order:
        visit(name, ())
    return result


# ---------------------------------------------------------------- changes


@dataclass(frozen=True)
class Change:
    """What the engine does with one resource between two renders."""

    name: str
    type: str
    action: str  # create | update | replace | delete | same
    delete_before_replace: bool = False
    keys: tuple[str, ...] = ()


def changes_between(old: Render | None, new: Render) -> dict[str, Change]:
    """Per custom resource of either render: from tooling/changes/ when there is an old
    render, every resource a `create` when there is none (day 0)."""
    if old is None:
        return {r.name: Change(r.name, r.type, "create") for r in new.custom_resources}
    from tooling import changes  # the one table of replacement rules

    result = {}
    for entry in changes.diff(old, new):
        entry = entry if isinstance(entry, dict) else asdict(entry)
        action = str(entry.get("action", "same"))
        strategy = str(entry.get("strategy") or "")
        result[entry["name"]] = Change(
            entry["name"],
            entry["type"],
            action,
            delete_before_replace="delete-before" in strategy or "deleteBeforeReplace" in strategy,
            keys=tuple(entry.get("keys") or ()),
        )
    for resource in new.custom_resources:
        result.setdefault(resource.name, Change(resource.name, resource.type, "same"))
    return result


# ---------------------------------------------------------------- the executor


@dataclass
class Applied:
    steps: list[StepResult] = field(default_factory=list)
    state: dict[str, RecordedResource] = field(default_factory=dict)  # what now exists
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(step.ok for step in self.steps)


def _ssh_opts(value: Any) -> list[str]:
    """A provider's `sshOpts` as the engine hands it over: provider inputs that are not
    strings arrive JSON-encoded."""
    if isinstance(value, str):
        value = json.loads(value) if value else []
    return [str(option) for option in value or []]


class Executor:
    """Runs resource steps in namespaces. `hosts` maps a node IP to where its things run."""

    def __init__(
        self,
        hosts: dict[str, standins.Host],
        *,
        workers: int = 8,
        log_dir: Path,
        on_step: Callable[[StepResult], None] | None = None,
        outputs: dict[str, dict[str, str]] | None = None,
        ssh: sshd.Client | None = None,
    ):
        self.hosts = hosts
        self.ssh = ssh  # how commands reach the nodes; None: they cannot (unit tests of the graph)
        self._docker_dialled: dict[str, tuple[bool, str]] = {}
        # What the docker provider left of each resource this apply (its outputs in the state:
        # a container's id, initErrors after a partial create); None: deleted.
        self.live: dict[str, dict[str, Any] | None] = {}
        self.workers = workers
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.on_step = on_step
        self.started = time.monotonic()
        self.outputs: dict[str, dict[str, str]] = dict(outputs or {})  # command stdout/stderr
        self._lock = threading.Lock()

    # ------------------------------------------------ where a resource runs

    def host_of(self, resource: RecordedResource, rendered: Render) -> standins.Host | None:
        inputs = plain(resource.inputs)
        if resource.type == COMMAND:
            ip = (inputs.get("connection") or {}).get("host")
        elif resource.provider and "::" in resource.provider:
            provider_name = resource.provider.split("::")[-2]
            provider = next((r for r in rendered.resources if r.name == provider_name), None)
            address = str(plain(provider.inputs).get("host", "")) if provider else ""
            ip = address.rsplit("@", 1)[-1].split(":")[0] if address.startswith("ssh://") else None
        else:
            return None
        if ip is None:
            return None
        if ip not in self.hosts:
            raise ExecutorError(f"{resource.name}: host {ip} is not a node of the lab")
        return self.hosts[ip]

    # ------------------------------------------------ one resource operation

    def _record(self, result: StepResult) -> StepResult:
        if self.on_step is not None:
            self.on_step(result)
        return result

    def _step_name(self, resource: RecordedResource, host: standins.Host | None) -> tuple[str, str]:
        node = host.node if host is not None else "-"
        name = resource.name.removeprefix(f"{node}-") if host is not None else resource.name
        if resource.type == CONTAINER:
            with contextlib.suppress(standins.StandInError):
                name = standins.stand_in_for(
                    standins.Container.from_inputs(resource.name, plain(resource.inputs))
                ).kind
        return node, name

    def run_op(
        self, op: str, resource: RecordedResource, rendered: Render, *, grace: float = 0
    ) -> StepResult:
        started = time.monotonic()
        host = self.host_of(resource, rendered)
        node, step = self._step_name(resource, host)
        try:
            ok, detail = self._dispatch(op, resource, host, rendered)
        except (standins.StandInError, substitutions.SubstitutionError, ExecutorError, OSError) as error:
            ok, detail = False, str(error)
        except subprocess.TimeoutExpired as error:
            ok, detail = False, f"timed out after {error.timeout:g} s"
        return self._record(
            StepResult(
                node,
                step,
                ok,
                detail,
                resource.name,
                op,
                round(started - self.started, 3),
                round(time.monotonic() - started, 3),
            )
        )

    def _dial_docker(self, resource: RecordedResource, rendered: Render) -> tuple[bool, str]:
        """What pulumi-docker does first on a host: ssh to `ssh://user@ip` with the provider's
        `sshOpts` (the program's pinned host key) and reach the daemon as that user. Once per
        provider and apply."""
        provider_name = (
            resource.provider.split("::")[-2] if resource.provider and "::" in resource.provider else ""
        )
        provider = next((r for r in rendered.resources if r.name == provider_name), None)
        if provider is None or self.ssh is None:
            return True, ""
        inputs = plain(provider.inputs)
        address = str(inputs.get("host", ""))
        with self._lock:
            known = self._docker_dialled.get(address)
        if known is not None:
            return known
        user, _, ip = address.removeprefix("ssh://").rpartition("@")
        done = self.ssh.run(
            user=user or "root",
            ip=ip.split(":")[0],
            command="docker version --format '{{.Server.Version}}'",
            host_key=None,
            verify=_ssh_opts(inputs.get("sshOpts")),
            timeout=60,
        )
        outcome = (
            (True, "")
            if done.returncode == 0
            else (False, f"docker provider {address}: {sshd.describe(done)}")
        )
        with self._lock:
            self._docker_dialled[address] = outcome
        return outcome

    def _dispatch(
        self, op: str, resource: RecordedResource, host: standins.Host | None, rendered: Render
    ) -> tuple[bool, str]:
        inputs = plain(resource.inputs)
        if resource.type == COMMAND:
            if host is None:
                raise ExecutorError(f"{resource.name}: no connection.host")
            text = (
                inputs.get("delete")
                if op == "delete"
                else (
                    inputs.get("update") or inputs.get("create") if op == "update" else inputs.get("create")
                )
            )
            if not text:
                return True, f"no {op} command"
            return self._run_command(resource, host, op, text, inputs)
        if resource.type in (CONTAINER, IMAGE):
            if host is None:
                raise ExecutorError(f"{resource.name}: its docker provider has no ssh:// host")
            if op != "delete":
                dialled, why = self._dial_docker(resource, rendered)
                if not dialled:
                    return False, why
            if resource.type == IMAGE:
                return self._image(op, resource, rendered)
            return self._container(op, resource, host, rendered)
        if resource.type.startswith(PROVIDER_PREFIX):
            return True, "provider"
        return True, f"the lab has nothing to run for {resource.type} (skipped)"

    # ------------------------------------------------ containers and images (dockerprovider.py)

    def _docker(self, resource: RecordedResource, rendered: Render, request: dict, timeout: float) -> dict:
        """One step of the docker provider on the resource's host: the agent over the provider's
        ssh, as its user, with its `sshOpts`."""
        provider = self._provider(resource, rendered)
        if provider is None or self.ssh is None:
            raise ExecutorError(f"{resource.name}: no docker provider to reach its host")
        inputs = plain(provider.inputs)
        user, _, ip = str(inputs.get("host", "")).removeprefix("ssh://").rpartition("@")
        done = self.ssh.run(
            user=user or "root",
            ip=ip.split(":")[0],
            command=dockerprovider.agent_command(),
            host_key=None,
            verify=_ssh_opts(inputs.get("sshOpts")),
            stdin=json.dumps(request),
            timeout=timeout,
        )
        for text in (done.stdout, done.stderr):
            lines = [line for line in text.strip().splitlines() if line.startswith("{")]
            if lines:
                with contextlib.suppress(ValueError):
                    return json.loads(lines[-1])
        return {"ok": False, "error": f"docker provider: {sshd.describe(done)[-1500:]}"}

    def _provider(self, resource: RecordedResource, rendered: Render) -> RecordedResource | None:
        name = resource.provider.split("::")[-2] if resource.provider and "::" in resource.provider else ""
        return next((r for r in rendered.resources if r.name == name), None)

    def _image(self, op: str, resource: RecordedResource, rendered: Render) -> tuple[bool, str]:
        inputs = plain(resource.inputs)
        if op == "delete":
            # resourceDockerImageDelete -> removeImage: keep_locally leaves the image.
            return True, "kept locally" if inputs.get("keepLocally") else "left (the lab removes no image)"
        answer = self._docker(
            resource, rendered, {"op": "pull", "image": inputs["name"]}, timeout=DOCKER_STEP_MARGIN * 5
        )
        if not answer.get("ok"):
            return False, f"Unable to read Docker image into resource: {answer.get('error')}"
        self._live(resource.name, {"repoDigest": answer["id"]})
        return (
            True,
            f"{inputs['name']} {'pulled' if answer.get('pulled') else 'found locally'} ({answer['id'][:19]})",
        )

    def _live(self, name: str, outputs: dict[str, Any] | None) -> None:
        with self._lock:
            self.live[name] = outputs

    def _container(
        self, op: str, resource: RecordedResource, host: standins.Host, rendered: Render
    ) -> tuple[bool, str]:
        inputs = plain(resource.inputs)
        known = dict(resource.outputs or {})  # what the state holds: id, initErrors, mustRun
        ident = str(known.get("id") or inputs.get("name") or resource.name)
        if op == "delete":
            clock = float(host.lab_env.get("QCL_LAB_STOP_CLOCK", "1"))  # lifecycle says which
            grace = round(float(inputs.get("destroyGraceSeconds") or 0) * clock)
            request = {"op": "delete", "id": ident, "grace": grace}
            answer = self._docker(resource, rendered, request, timeout=grace + DOCKER_STEP_MARGIN)
            if not answer.get("ok"):
                return False, str(answer.get("error"))
            self._live(resource.name, None)
            return True, f"stopped (grace {grace} s) and removed {ident[:12]}"
        if op in ("update", "rerun") and known.get("id"):
            # resourceDockerContainerUpdate: the in-place fields, then a container that is not
            # running (a partial create, or `must_run` false after a read) is started again.
            if op == "update":
                body = {"RestartPolicy": {"Name": str(inputs.get("restart") or "no"), "MaximumRetryCount": 0}}
                answer = self._docker(
                    resource, rendered, {"op": "update", "id": ident, "body": body}, DOCKER_STEP_MARGIN
                )
                if not answer.get("ok"):
                    return False, str(answer.get("error"))
            state = self._docker(resource, rendered, {"op": "inspect", "id": ident}, DOCKER_STEP_MARGIN)
            running = bool((state.get("state") or {}).get("Running"))
            if running and not known.get("initErrors"):
                self._live(resource.name, {"id": ident, "mustRun": True})
                return True, "running" if op == "rerun" else "updated in place"
            if state.get("state") is not None:
                answer = self._docker(resource, rendered, {"op": "start", "id": ident}, DOCKER_STEP_MARGIN)
                if not answer.get("ok"):
                    self._live(resource.name, {"id": ident, "initErrors": [str(answer.get("error"))]})
                    return False, str(answer.get("error"))
                self._live(resource.name, {"id": ident, "mustRun": True})
                return True, f"started {ident[:12]} again"
            op = "create"  # gone from the daemon: created afresh
        body, notes = dockerprovider.create_body(
            inputs,
            lambda path: substitutions.host_path(path, etc_root=host.etc_root, state_dir=host.state_dir),
        )
        request = {
            "op": "create",
            "name": str(inputs.get("name") or resource.name),
            "body": body,
            "uploads": dockerprovider.uploads(inputs),
            "start": inputs.get("start", True) is not False,
        }
        answer = self._docker(resource, rendered, request, timeout=DOCKER_STEP_MARGIN * 5)
        if not answer.get("ok"):
            if answer.get("id"):
                # Created, then failed (upload, start): the state keeps it, with its id.
                self._live(resource.name, {"id": answer["id"], "initErrors": [str(answer.get("error"))]})
            return False, str(answer.get("error"))
        state = answer.get("state") or {}
        # resourceDockerContainerRead: a container not running records must_run = false.
        self._live(resource.name, {"id": answer["id"], "mustRun": bool(state.get("Running"))})
        shown = "running" if state.get("Running") else f"exited {state.get('ExitCode')} (must_run false)"
        return True, "; ".join([f"container {answer['id'][:12]} {shown}", *notes])

    def _run_command(
        self, resource: RecordedResource, host: standins.Host, op: str, text: str, inputs: dict[str, Any]
    ) -> tuple[bool, str]:
        script = substitutions.script(
            text, resource=resource.name, etc_root=host.etc_root, state_dir=host.state_dir
        )
        path = self.log_dir / f"{resource.name}.{op if op != 'rerun' else 'create'}.sh"
        path.write_text(script)
        if self.ssh is None:
            raise ExecutorError(f"{resource.name}: no SSH client: the lab reaches its nodes over SSH only")
        connection = inputs.get("connection") or {}
        environment = {key: str(value) for key, value in (inputs.get("environment") or {}).items()}
        refused = sshd.refused_environment(environment)
        if refused:
            # pulumi-command's Setenv fails the command when sshd refuses a variable.
            return False, (
                f"could not set environment variable {refused[0]!r}: sshd accepts only "
                f"AcceptEnv {' '.join(sshd.ACCEPT_ENV)}"
            )
        # pulumi-command also sends the previous run's output (PULUMI_COMMAND_STDOUT/STDERR),
        # optimistically: sshd's AcceptEnv refuses them, and the command runs without them.
        try:
            done = self.ssh.run(
                user=str(connection.get("user") or "root"),
                ip=str(connection.get("host") or host.ip),
                command=script,
                host_key=connection.get("hostKey"),
                environment=environment,
                stdin=inputs.get("stdin"),
                timeout=COMMAND_TIMEOUT,
                kex=sshd.PULUMI_COMMAND_KEX,
            )
        except OSError as error:
            if error.errno != errno.E2BIG:
                raise
            # sshd runs the command as `$SHELL -c '<command>'`: one argument, which Linux caps;
            # the client's own argv holds it whole too, so it fails here first.
            return False, (
                f"the command is {len(script.encode())} bytes, over Linux's limit of {MAX_ARG_STRLEN} "
                "for one argument or environment string: a host's sshd could not run it either"
            )
        with self._lock:
            self.outputs[resource.name] = {"stdout": done.stdout, "stderr": done.stderr}
        if done.returncode != 0:
            return False, f"exit {done.returncode}: {sshd.describe(done)[-2000:]}"
        return True, (done.stdout + done.stderr).strip()[-2000:]

    # ------------------------------------------------ a whole apply

    def apply(
        self,
        old: Render | None,
        new: Render,
        *,
        state: dict[str, RecordedResource] | None = None,
        rerun: bool = False,
    ) -> Applied:
        """`pulumi up` from `old` to `new`. `rerun`: every command runs again as an in-place
        update would, containers whose inputs did not change are left running (the lab's
        idempotency check)."""
        self.started = time.monotonic()
        applied = Applied(state=dict(state or {r.name: r for r in (old.custom_resources if old else [])}))
        changes = changes_between(old, new)
        new_by_name = {r.name: r for r in new.custom_resources}
        old_by_name = {r.name: r for r in old.custom_resources} if old else {}
        deps = graph(new)
        order = topological(deps, [r.name for r in new.custom_resources])
        deferred: list[str] = []  # old resources to delete at the end
        failed = threading.Event()

        def step(name: str) -> list[StepResult]:
            change = changes[name]
            resource = new_by_name[name]
            before = old_by_name.get(name)
            results: list[StepResult] = []
            action = change.action
            if action == "same" and before is not None and (before.outputs or {}).get("initErrors"):
                # pulumi/pulumi pkg/resource/deploy/step_generator.go applyReplaceOnChanges: a
                # resource with init errors gets an update even when its inputs are unchanged.
                action = "update"
            if rerun and action == "same":
                action = "rerun"
            if action == "same":
                return results
            if action == "replace" and change.delete_before_replace:
                results.append(self.run_op("delete", before, old))
                if not results[-1].ok:
                    return results
                applied.state.pop(name, None)
                action = "create"
            elif action == "replace":
                deferred.append(name)
                action = "create"
            if action == "rerun" and resource.type == COMMAND:
                action = "update"
            if action in ("update", "rerun") and before is not None and resource.type == CONTAINER:
                # The provider acts on the container the state holds (its id).
                resource = dataclasses.replace(resource, outputs=dict(before.outputs or {}))
            results.append(self.run_op(action, resource, new))
            with self._lock:
                live = self.live.get(name, resource.outputs) if name in self.live else None
            if results[-1].ok or (live and live.get("initErrors")):
                # A partial create is recorded too, with its id and init errors (the engine's
                # StatusPartialFailure), so the next apply finds what docker holds.
                stored = resource if live is None else dataclasses.replace(resource, outputs=dict(live))
                applied.state[name] = stored
            return results

        pending = {name: set(deps.get(name, ())) & set(order) for name in order}
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            running: dict[Future, str] = {}
            finished: set[str] = set()
            while pending or running:
                if not failed.is_set():
                    for name in [n for n in order if n in pending and pending[n] <= finished]:
                        del pending[name]
                        running[pool.submit(step, name)] = name
                elif not running:
                    break
                if not running:
                    if pending:
                        stuck = ", ".join(sorted(pending))
                        raise ExecutorError(f"nothing can start; waiting forever: {stuck}")
                    break
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for future in done:
                    name = running.pop(future)
                    results = future.result()
                    applied.steps += results
                    if all(r.ok for r in results):
                        finished.add(name)
                    else:
                        failed.set()
        if failed.is_set():
            applied.seconds = time.monotonic() - self.started
            return applied
        # Deletes last: removed resources and create-before-delete replacements, each only
        # after whatever depended on it is gone (reverse dependency order of the old render).
        removed = [name for name, change in changes.items() if change.action == "delete"]
        doomed = set(removed) | set(deferred)
        if old is not None and doomed:
            old_deps = graph(old)
            old_order = topological(old_deps, [r.name for r in old.custom_resources])
            for name in reversed([n for n in old_order if n in doomed]):
                result = self.run_op("delete", old_by_name[name], old)
                applied.steps.append(result)
                if not result.ok:
                    break
                if name in removed:
                    applied.state.pop(name, None)
        applied.seconds = time.monotonic() - self.started
        return applied


def state_render(stack: str, state: dict[str, RecordedResource], new: Render) -> Render:
    """What exists after an apply, as a render: the version of each resource that exists (the
    new one where its step ran, the old one where it did not), components from the new render,
    leftovers of the old one after them."""
    resources = [state.get(r.name, r) for r in new.resources if not r.custom or r.name in state]
    names = {r.name for r in resources}
    resources += [r for name, r in state.items() if name not in names]
    return Render(stack, resources, new.outputs, [])
