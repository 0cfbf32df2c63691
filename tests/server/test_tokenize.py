"""/tokenize and /detokenize: the ids a request would be served with, their text, and clear errors."""
from scheduler.admission import QueueFullError
from tests.server.conftest import MAX_MODEL_LEN, StandInEngine

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime number."}]


def test_a_conversation_tokenizes_to_the_ids_its_chat_request_is_served_with(make_client):
    client, engine = make_client(StandInEngine(submit_error=QueueFullError()))
    reply = client.post("/tokenize", json={"model": "SmolLM2-135M-Instruct", "messages": MESSAGES})
    client.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert reply.status_code == 200
    body = reply.json()
    assert body["tokens"] == engine.requests[0].prompt_token_ids
    assert (body["count"], body["max_model_len"], body["token_strs"]) == (len(body["tokens"]), MAX_MODEL_LEN, None)


def test_a_prompt_tokenizes_as_a_completion_does_and_detokenizes_back(make_client, tokenizer):
    client, engine = make_client(StandInEngine(submit_error=QueueFullError()))
    text = "def add(a, b):\n    return a + b"
    tokens = client.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    client.post("/v1/completions", json={"prompt": text})
    assert tokens["tokens"] == engine.requests[0].prompt_token_ids
    assert tokens["token_strs"] == tokenizer.convert_ids_to_tokens(tokens["tokens"])
    plain = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": plain}).json() == {"prompt": text}


def test_without_the_generation_prompt_the_reply_opening_is_left_out(make_client, tokenizer):
    client, _ = make_client()
    opened = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    closed = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert opened[:len(closed)] == closed and tokenizer.decode(opened[len(closed):]) == "<|im_start|>assistant\n"


def test_bad_input_is_a_400_naming_what_is_wrong(make_client):
    client, _ = make_client()
    cases = [({}, "give either prompt or messages"),
             ({"prompt": "a", "messages": MESSAGES}, "give either prompt or messages"),
             ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
             ({"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens")]
    for body, said in cases:
        reply = client.post("/tokenize", json=body)
        assert reply.status_code == 400 and said in reply.json()["error"]["message"], body
    reply = client.post("/detokenize", json={"tokens": [1, 10**9]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens"
    assert "tokens[1]" in reply.json()["error"]["message"]
    assert client.post("/tokenize", json={"model": "other", "prompt": "a"}).status_code == 404


def test_an_api_key_guards_them_as_it_guards_the_openai_routes(make_client):
    client, _ = make_client(api_key="secret")
    assert client.post("/tokenize", json={"prompt": "a"}).status_code == 401
    assert client.post("/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer secret"}).status_code == 200
