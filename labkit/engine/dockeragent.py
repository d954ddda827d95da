"""The lab's Docker provider on the node: Engine API calls for one resource step.

Run as `python3 -c <this file>` over SSH by labkit/engine/dockerprovider.py (which explains each step
and cites the provider's source); reads one JSON request on stdin, prints one JSON answer.
Stdlib only. Talks to `$DOCKER_HOST` (a unix socket), as the docker CLI would.
"""

import http.client
import io
import json
import os
import socket
import sys
import tarfile
import time
import urllib.parse

API = "v1.41"  # Debian's docker.io 20.10 speaks Engine API 1.41


class Unix(http.client.HTTPConnection):
    def __init__(self, path, timeout):
        super().__init__("docker", timeout=timeout)
        self.path_ = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path_)


host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
path = host[len("unix://") :] if host.startswith("unix://") else host


def call(method, url, body=None, timeout=60, ctype="application/json"):
    conn = Unix(path, timeout)
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    try:
        conn.request(
            method, "/" + API + url, body=data, headers={"Content-Type": ctype} if data is not None else {}
        )
        response = conn.getresponse()
        raw = response.read()
    except FileNotFoundError:
        raise SystemExit(
            json.dumps(
                {
                    "ok": False,
                    "stage": "connect",
                    "error": "Cannot connect to the Docker daemon at "
                    + host
                    + ". Is the docker daemon running?",
                }
            )
        ) from None
    except (ConnectionRefusedError, PermissionError) as error:
        raise SystemExit(
            json.dumps(
                {
                    "ok": False,
                    "stage": "connect",
                    "error": "Cannot connect to the Docker daemon at " + host + ": " + str(error),
                }
            )
        ) from None
    text = raw.decode(errors="replace")
    try:
        value = json.loads(text) if text.strip() else None
    except ValueError:
        value = text
    return response.status, value


def message(value):
    return value.get("message") if isinstance(value, dict) else str(value)


def find_image(name):
    status, value = call("GET", "/images/" + urllib.parse.quote(name, safe="") + "/json")
    if status == 200:
        return {"ok": True, "id": value["Id"], "pulled": False}
    repo, tag = name, "latest"
    head, sep, tail = name.rpartition(":")
    if sep and "/" not in tail:
        repo, tag = head, tail
    status, value = call(
        "POST", "/images/create?" + urllib.parse.urlencode({"fromImage": repo, "tag": tag}), b"", timeout=600
    )
    if status != 200:
        return {"ok": False, "stage": "pull", "error": message(value)}
    if isinstance(value, dict) and value.get("error"):
        return {"ok": False, "stage": "pull", "error": value["error"]}
    if isinstance(value, str):
        for line in value.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("error"):
                return {"ok": False, "stage": "pull", "error": event["error"]}
    status, value = call("GET", "/images/" + urllib.parse.quote(name, safe="") + "/json")
    if status != 200:
        return {"ok": False, "stage": "pull", "error": message(value)}
    return {"ok": True, "id": value["Id"], "pulled": True}


def state(ident):
    status, value = call("GET", "/containers/" + ident + "/json")
    if status != 200:
        return None
    return value["State"]


request = json.load(sys.stdin)
op = request["op"]
if op == "version":
    status, value = call("GET", "/version")
    answer = {
        "ok": status == 200,
        "version": (value or {}).get("Version") if status == 200 else None,
        "error": None if status == 200 else message(value),
    }
elif op == "pull":
    answer = find_image(request["image"])
elif op == "create":
    answer = find_image(request["body"]["Image"])
    if answer["ok"]:
        status, value = call(
            "POST", "/containers/create?" + urllib.parse.urlencode({"name": request["name"]}), request["body"]
        )
        if status != 201:
            answer = {"ok": False, "stage": "create", "error": message(value)}
        else:
            ident = value["Id"]
            answer = {"ok": True, "id": ident}
            for upload in request.get("uploads", []):
                buffer = io.BytesIO()
                with tarfile.open(fileobj=buffer, mode="w") as tar:
                    data = upload["content"].encode()
                    info = tarfile.TarInfo(upload["file"].lstrip("/"))
                    info.size = len(data)
                    info.mode = upload["mode"]
                    info.mtime = time.time()
                    tar.addfile(info, io.BytesIO(data))
                status, value = call(
                    "PUT",
                    "/containers/" + ident + "/archive?path=/",
                    buffer.getvalue(),
                    ctype="application/x-tar",
                )
                if status != 200:
                    answer = {
                        "ok": False,
                        "id": ident,
                        "stage": "upload",
                        "error": "Unable to upload volume content: " + message(value),
                    }
                    break
            if answer["ok"] and request.get("start", True):
                status, value = call("POST", "/containers/" + ident + "/start", b"")
                if status not in (204, 304):
                    answer = {
                        "ok": False,
                        "id": ident,
                        "stage": "start",
                        "error": "Unable to start container: " + message(value),
                    }
            if answer["ok"]:
                answer["state"] = state(ident)
elif op == "start":
    status, value = call("POST", "/containers/" + request["id"] + "/start", b"")
    answer = {
        "ok": status in (204, 304),
        "id": request["id"],
        "error": None if status in (204, 304) else "Unable to start container: " + message(value),
    }
    if answer["ok"]:
        answer["state"] = state(request["id"])
elif op == "update":
    status, value = call("POST", "/containers/" + request["id"] + "/update", request["body"])
    answer = {
        "ok": status == 200,
        "id": request["id"],
        "error": None if status == 200 else "Unable to update a container: " + message(value),
    }
elif op == "inspect":
    answer = {"ok": True, "state": state(request["id"])}
elif op == "delete":
    ident, grace = request["id"], int(request.get("grace", 0))
    status, value = call("POST", "/containers/" + ident + f"/stop?t={grace}", b"", timeout=grace + 60)
    answer = {"ok": True, "id": ident}
    if status not in (204, 304, 404):
        answer = {
            "ok": False,
            "id": ident,
            "stage": "stop",
            "error": f"Error stopping container {ident}: {message(value)}",
        }
    else:
        status, value = call("DELETE", "/containers/" + ident + "?force=1", timeout=60)
        if status not in (204, 404) and "is already in progress" not in str(message(value)):
            answer = {
                "ok": False,
                "id": ident,
                "stage": "remove",
                "error": f"Error deleting container {ident}: {message(value)}",
            }
        else:
            call("POST", "/containers/" + ident + "/wait?condition=removed", b"", timeout=60)
            answer["removed"] = status == 204
else:
    answer = {"ok": False, "error": "unknown op " + op}
print(json.dumps(answer))
