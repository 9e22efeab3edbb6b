"""The promotion loop's error line (gpu_train.serving.promote.one_line): an API server's refusal is logged as its
status and its own message on one line, not the client's multi-line dump of the response.

Run: .venv/bin/pytest tests/gpu_train/serving/test_promote.py -q
"""

from __future__ import annotations

import json

from kubernetes.client.rest import ApiException

from gpu_train.serving.promote import one_line


def refusal(status: int, reason: str, body: str | None) -> ApiException:
    exc = ApiException(status=status, reason=reason)
    exc.body = body
    exc.headers = {"Audit-Id": "a7228029", "Content-Type": "application/json"}
    return exc


def test_an_api_refusal_is_its_status_and_message_on_one_line():
    body = json.dumps({"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404,
                       "message": 'services "chat-v4-predictor" not found'})
    exc = refusal(404, "Not Found", body)
    assert "\n" in str(exc)  # what the client's exception says, headers and body over several lines
    assert one_line(exc) == 'the API server answered 404 Not Found: services "chat-v4-predictor" not found'


def test_an_answer_without_a_status_body_and_any_other_error_stay_on_one_line():
    assert one_line(refusal(503, "Service Unavailable", "<html>\nbusy\n</html>")) == \
        "the API server answered 503 Service Unavailable: no message"
    assert one_line(refusal(500, "Internal Server Error", None)) == \
        "the API server answered 500 Internal Server Error: no message"
    assert one_line(ValueError("quality check:\n  no answer")) == "quality check: no answer"
