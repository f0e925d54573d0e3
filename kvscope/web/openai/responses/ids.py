"""The id of a response of the Responses API, named after its request's.

Request `req-<rest>` runs response `resp_<rest>`, so a response's id says which
request to cancel and, under Ray Serve, which replica stores it (`replicas.ids`).
Plain Python, no imports: Serve's proxy reads it for every call.
"""


def response_id(request_id: str) -> str:
    """The id of the response whose request is `request_id`."""
    return "resp_" + request_id.removeprefix("req-")


def request_of_response(response_id: str) -> str:
    """The id of the request of the response `response_id`."""
    return "req-" + response_id.removeprefix("resp_")
