"""What pulumi-docker does with a Container or a RemoteImage, done on a lab node's real dockerd.

pulumi-docker wraps kreuzwerker/terraform-provider-docker (v4.5.0 as the program cites it); its
steps, read in `internal/provider/`:

- RemoteImage create (`resource_docker_image_funcs.go` resourceDockerImageCreate -> findImage):
  an image found locally is used as is, else it is pulled; delete with `keep_locally` leaves it.
- Container create (`resource_docker_container_funcs.go` resourceDockerContainerCreate): findImage
  (pulls a missing image), ContainerCreate with the inputs as Config/HostConfig, **d.SetId(id)**,
  each `upload` copied in (CopyToContainer of a one-file tar at "/"), ContainerStart, then Read.
  A start that fails returns the error with the id already set: the bridge turns that into an
  initialization error carrying the id (pulumi-terraform-bridge pkg/tfbridge/provider.go Create
  -> initializationError), and the engine records the resource *with* its id and `InitErrors`
  (pulumi/pulumi pkg/resource/deploy/step.go CreateStep.Apply: StatusPartialFailure). So the
  created container is in the state, not forgotten.
- Container read (resourceDockerContainerRead): a container that is not running while
  `must_run` is set records `must_run=false`, so the next update starts it again.
- Container update (resourceDockerContainerUpdate): `restart`/resources in place
  (ContainerUpdate); `must_run` false -> true starts it (ContainerStart).
- Container delete (resourceDockerContainerDelete): ContainerStop with timeout
  `destroy_grace_seconds` (0 when unset), ContainerRemove(Force), ContainerWait; "No such
  container" is not an error.

The lab sends these as Docker Engine API calls from the node itself: `AGENT`, run over the
program's own SSH path to the host (the provider's `ssh://user@ip` with its `sshOpts`) as that
user, speaks to `$DOCKER_HOST` (the node's daemon; sshd's SetEnv gives it, as a host's socket
would be /var/run/docker.sock). One SSH session per resource step; request and answer are JSON.

The one change the lab makes to a container spec for this machine: `dockerd.clamp_ulimits`
(root here lacks CAP_SYS_RESOURCE). It is listed with the other substitutions (docs/lab.md).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from labkit.hosts import dockerd


def _gpus(value: str) -> list[dict[str, Any]]:
    """docker/cli opts.GpuOpts for `gpus` (kreuzwerker normalizeGPUOptionString): "all" is every
    GPU with the gpu capability."""
    count = -1 if value in ("all", "") else int(value) if value.isdigit() else -1
    return [{"Driver": "", "Count": count, "DeviceIDs": None, "Capabilities": [["gpu"]], "Options": {}}]


def create_body(inputs: dict[str, Any], host_path) -> tuple[dict[str, Any], list[str]]:
    """The Engine API's POST /containers/create body for a container's inputs (as kreuzwerker
    resourceDockerContainerCreate builds Config and HostConfig), and the lab's notes.
    `host_path(path) -> path`: where the lab keeps a host path a volume or mount names."""
    notes: list[str] = []
    config: dict[str, Any] = {"Image": inputs.get("image", "")}
    if inputs.get("envs"):
        config["Env"] = [str(item) for item in inputs["envs"]]
    if inputs.get("command"):
        config["Cmd"] = [str(item) for item in inputs["command"]]
    if inputs.get("entrypoints"):
        config["Entrypoint"] = [str(item) for item in inputs["entrypoints"]]
    for key, field in (("user", "User"), ("workingDir", "WorkingDir"), ("hostname", "Hostname")):
        if inputs.get(key):
            config[field] = str(inputs[key])
    if inputs.get("stopSignal"):
        config["StopSignal"] = str(inputs["stopSignal"])
    if inputs.get("stopTimeout") is not None:
        config["StopTimeout"] = int(inputs["stopTimeout"])
    if inputs.get("labels"):
        config["Labels"] = {item["label"]: str(item["value"]) for item in inputs["labels"]}
    host: dict[str, Any] = {
        "RestartPolicy": {
            "Name": str(inputs.get("restart") or "no"),
            "MaximumRetryCount": int(inputs.get("maxRetryCount") or 0),
        },
        "Init": bool(inputs.get("init", False)),
        "Privileged": bool(inputs.get("privileged", False)),
    }
    binds, volumes = [], {}
    for volume in inputs.get("volumes") or []:
        source = volume.get("hostPath") or volume.get("volumeName")
        if not source or not volume.get("containerPath"):
            continue
        mode = "ro" if volume.get("readOnly") else "rw"
        if volume.get("selinuxRelabel"):
            mode += "," + str(volume["selinuxRelabel"])
        if volume.get("hostPath"):
            source = host_path(source)
        binds.append(f"{source}:{volume['containerPath']}:{mode}")
        volumes[volume["containerPath"]] = {}
    if binds:
        host["Binds"] = binds
        config["Volumes"] = volumes
    mounts = []
    for mount in inputs.get("mounts") or []:
        entry = {
            "Type": mount.get("type", "bind"),
            "Target": mount["target"],
            "ReadOnly": bool(mount.get("readOnly")),
        }
        if mount.get("source"):
            entry["Source"] = host_path(mount["source"]) if entry["Type"] == "bind" else mount["source"]
        if (mount.get("bindOptions") or {}).get("propagation"):
            entry["BindOptions"] = {"Propagation": mount["bindOptions"]["propagation"]}
        mounts.append(entry)
    if mounts:
        host["Mounts"] = mounts
    for key, field in (("networkMode", "NetworkMode"), ("ipcMode", "IpcMode"), ("pidMode", "PidMode")):
        if inputs.get(key):
            host[field] = str(inputs[key])
    capabilities = inputs.get("capabilities") or {}
    if capabilities.get("adds"):
        host["CapAdd"] = list(capabilities["adds"])
    if capabilities.get("drops"):
        host["CapDrop"] = list(capabilities["drops"])
    if inputs.get("devices"):
        host["Devices"] = [
            {
                "PathOnHost": device["hostPath"],
                "PathInContainer": device.get("containerPath") or device["hostPath"],
                "CgroupPermissions": device.get("permissions") or "rwm",
            }
            for device in inputs["devices"]
        ]
    if inputs.get("ulimits"):
        ulimits = [
            {"name": u["name"], "soft": int(u.get("soft", 0)), "hard": int(u.get("hard", 0))}
            for u in inputs["ulimits"]
        ]
        ulimits, clamped = dockerd.clamp_ulimits(ulimits)
        notes += clamped
        host["Ulimits"] = [{"Name": u["name"], "Soft": u["soft"], "Hard": u["hard"]} for u in ulimits]
    if inputs.get("shmSize"):
        host["ShmSize"] = int(inputs["shmSize"]) * 1024 * 1024
    if inputs.get("gpus"):
        host["DeviceRequests"] = _gpus(str(inputs["gpus"]))
    config["HostConfig"] = host
    return config, notes


def uploads(inputs: dict[str, Any]) -> list[dict[str, Any]]:
    """Each `upload` as kreuzwerker copies it: one file, mode from `permissions`, 0744 when
    executable, else 0644."""
    result = []
    for upload in inputs.get("uploads") or []:
        mode = 0o744 if upload.get("executable") else 0o644
        if upload.get("permissions"):
            mode = int(str(upload["permissions"]), 8)
        result.append({"file": upload["file"], "content": upload.get("content", ""), "mode": mode})
    return result


AGENT = Path(__file__).with_name("dockeragent.py")


def agent_command() -> str:
    """The command the SSH session runs (one string for the user's login shell): the agent's
    source for `python3 -c`, stdlib only, so any node with Python runs it."""
    return "python3 -c " + shlex.quote(AGENT.read_text())
