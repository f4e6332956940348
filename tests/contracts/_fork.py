"""Run one function per environment, each in a freshly forked child whose environment is
exactly that one; collect what each child reports (a JSON-able dict, or the error)."""

import json
import os


def run_forked(env: dict, body) -> dict:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: exactly the planned environment, then torch_xla's code
        os.close(read_fd)
        os.environ.clear()
        os.environ.update(env)
        try:
            out = {"ok": True, **body()}
        except Exception as exc:  # report, do not raise: the parent asserts
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        os.write(write_fd, json.dumps(out).encode())
        os._exit(0)
    os.close(write_fd)
    chunks = []
    while chunk := os.read(read_fd, 65536):
        chunks.append(chunk)
    os.close(read_fd)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))
