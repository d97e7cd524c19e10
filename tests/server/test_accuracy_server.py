"""`kdaserve accuracy` against running servers: the same server as both arms is an A/A pair, and
its teacher-forced log-probs equal an in-process engine's on the same tasks."""

from pathlib import Path

from kdaserve.evidence import accuracy as acc
from kdaserve.models.tokenizer import ByteTokenizer


def test_server_arms(server):
    tasks = acc.next_line_tasks([Path(acc.__file__)], ByteTokenizer().encode, 5, context_lines=3, max_prompt_tokens=120)
    a = acc.measure(acc.ServerArm("A", server.url, "tiny"), tasks, 8)
    b = acc.measure(acc.ServerArm("B", server.url, "tiny"), tasks, 8)
    r = acc.compare(a, b, tasks)
    assert r["token_logprob_abs_diff"]["max"] == 0.0 and r["greedy_agreement"] == 1.0
    from kdaserve.engine import LLM

    llm = LLM("tiny", kda_prefill_backend="reference", kda_decode_backend="reference", max_model_len=1024, device="cpu",
              enforce_eager=True, seed=0)   # the server's model (server_helpers.make_engine)
    local = acc.EngineArm("engine", llm).score(tasks)
    assert all(abs(x - y) < 1e-4 for la, lb in zip(a["logprobs"], local) for x, y in zip(la, lb))


def test_server_arms_tokenize_with_the_servers_tokenizer(server):
    arm = acc.ServerArm("A", server.url, "tiny")
    assert arm.encode("def f():\n") == ByteTokenizer().encode("def f():\n")


def test_the_command_against_servers(server, tmp_path, capsys):
    import json

    from kdaserve.cli import main

    out = tmp_path / "r.json"
    assert main(["accuracy", "--a-url", server.url, "--b-url", server.url, "--served-model-name", "tiny",
                 "--data", acc.__file__, "--num-tasks", "3", "--max-tokens", "4", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tasks"] == 3 and r["greedy_agreement"] == 1.0 and r["token_logprob_abs_diff"]["max"] == 0.0
    assert "| greedy agreement |" in capsys.readouterr().out
