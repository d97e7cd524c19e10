"""`kdaserve accuracy` against running servers: the same server as both arms is an A/A pair, and
its teacher-forced log-probs equal an in-process engine's on the same tasks."""

from pathlib import Path

from kdaserve.bench import accuracy as acc
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
