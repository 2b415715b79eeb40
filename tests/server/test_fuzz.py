"""Schemathesis against the server's own /openapi.json: whatever it sends, no 5xx (bounded run)."""

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.server.server_helpers import start


def test_no_request_the_schema_allows_or_mangles_gets_a_5xx(tiny_dir):
    server = start(tiny_dir, admin_key="root", default_max_tokens=4)
    try:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        failures, statuses = [], []

        def check(case):
            for key in ("max_tokens", "max_output_tokens"):  # bound the run, not the input space
                if isinstance(case.body, dict) and isinstance(case.body.get(key), int):
                    case.body[key] = min(case.body[key], 4)
            response = case.call(headers={"Authorization": "Bearer root"}, timeout=30)
            statuses.append(response.status_code)
            try:
                case.validate_response(response, checks=[not_a_server_error])
            except Exception as e:  # collect, so one run reports every endpoint
                failures.append(f"{case.method} {case.path} {case.body!r:.200}: {e!s:.300}")

        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) == 10
        for op in operations:
            run = settings(
                max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
            )(given(case=op.as_strategy())(lambda case: check(case)))
            run()
        assert not failures, "\n".join(failures[:10])
        assert len(statuses) >= 60 and {200, 400} <= set(statuses), sorted(set(statuses))
    finally:
        server.stop()
