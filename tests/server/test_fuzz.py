"""A fuzz run over the OpenAPI schema (schemathesis): whatever the bodies, no 5xx. Every request
body the server takes is described in /openapi.json, so the fuzzer reaches every field."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

EXAMPLES = 25   # per operation; raise locally for a longer run


def test_no_input_makes_a_5xx(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= paths
    for op in operations:
        if op.path == "/metrics":
            continue

        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True)   # the same examples every run: CI verdicts repeat
        def check(case):
            if isinstance(case.body, dict) and case.path.startswith("/v1/"):
                case.body["max_tokens"] = 2   # short generations; every other field is the fuzzer's
                case.body.pop("max_completion_tokens", None)
            case.call_and_validate(checks=[not_a_server_error], timeout=60)

        check()
