"""The gateway's memory of where stored responses (OpenAI's Responses API) live: which requests
name one, the id read from an answer's first bytes, and the home tried first."""

import json

from shardline.gateway.response_homes import ResponseHomes, answered_id, named_response


def test_requests_that_name_a_stored_response():
    assert named_response("GET", "responses/resp_1", b"") == "resp_1"
    assert named_response("DELETE", "responses/resp_1", b"") == "resp_1"
    assert named_response("GET", "responses/resp_1/input_items", b"") == "resp_1"
    body = json.dumps({"input": "hi", "previous_response_id": "resp_2"}).encode()
    assert named_response("POST", "responses", body) == "resp_2"
    for method, path, raw in (
        ("POST", "responses", b'{"input": "hi"}'),
        ("POST", "responses", b'{"previous_response_id": 7}'),
        ("POST", "responses", b"not json"),
        ("POST", "responses", b"[1]"),
        ("POST", "chat/completions", body),
        ("GET", "models", b""),
    ):
        assert named_response(method, path, raw) is None, (method, path, raw)


def test_the_id_of_an_answer_whole_or_streamed():
    whole = json.dumps({"id": "resp_abc-1", "object": "response", "output": [{"id": "msg_x"}]}).encode()
    assert answered_id(whole) == "resp_abc-1"
    event = {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_9", "status": "in_progress"}}
    streamed = f"event: response.created\ndata: {json.dumps(event)}\n\n".encode()
    assert answered_id(streamed[:40]) is None  # not yet in the bytes read
    assert answered_id(streamed) == "resp_9"
    assert answered_id(json.dumps({"id": "msg_1"}).encode()) is None


def test_a_home_is_tried_first_and_the_oldest_is_forgotten():
    homes = ResponseHomes(size=2)
    order = ["a:1", "b:1", "c:1"]
    homes.learn("resp_1", "b:1")
    assert homes.first(order, "resp_1", str) == ["b:1", "a:1", "c:1"]
    assert homes.first(order, "resp_unknown", str) == order  # every replica, in the usual order
    homes.learn("resp_2", "c:1")
    homes.learn("resp_3", "a:1")
    assert homes.first(order, "resp_1", str) == order  # forgotten: the oldest of three
    assert homes.first(order, "resp_2", str)[0] == "c:1"
    homes.forget("resp_2")
    assert homes.first(order, "resp_2", str) == order
