"""vLLM's token routes on the real server: `/tokenize` gives the ids the generation
routes use (the usage counts agree, a chat too), `/detokenize` gives their text back,
bad bodies are 400s naming the field, another model a 404; `/version`."""

from __future__ import annotations

import kvscope
from kvscope.models.tokenizer import ByteTokenizer

from .conftest import Live

MODEL = "tiny-random"
TEXT = "Tokens, counted the same way everywhere."


def test_tokenize_agrees_with_the_generation_routes(live: Live) -> None:
    with live.client() as http:
        tokens = http.post("/tokenize", json={"model": MODEL, "prompt": TEXT}).json()
        completion = http.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1}).json()
        assert tokens["count"] == len(tokens["tokens"]) == completion["usage"]["prompt_tokens"]
        assert tokens["max_model_len"] == http.get("/v1/models").json()["data"][0]["max_model_len"]
        assert tokens["token_strs"] is None
        bare = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
        assert (
            bare["count"] < tokens["count"] and tokens["tokens"][-bare["count"] :] == bare["tokens"]
        )
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        assert text == TEXT
        strs = http.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
        assert "".join(strs["token_strs"]).endswith(TEXT)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
        chat_tokens = http.post("/tokenize", json={"messages": messages}).json()
        chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert chat_tokens["count"] == chat.json()["usage"]["prompt_tokens"]


def test_bad_token_bodies_are_refused_by_name(live: Live) -> None:
    vocab_size = ByteTokenizer.vocab_size  # the tiny-random model's
    with live.client() as http:
        for path, body, param in [
            ("/tokenize", {}, "prompt"),
            (
                "/tokenize",
                {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
                "prompt",
            ),
            ("/tokenize", {"prompt": 5}, "prompt"),
            ("/tokenize", {"prompt": "x", "suffix": "y"}, "suffix"),
            ("/tokenize", {"messages": []}, "messages"),
            (
                "/tokenize",
                {"prompt": "x", "chat_template_kwargs": {"a": 1}},
                "chat_template_kwargs",
            ),
            ("/tokenize", {"prompt": "x", "tools": []}, "tools"),
            (
                "/tokenize",
                {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": False},
                "add_special_tokens",
            ),
            ("/detokenize", {"tokens": [1, vocab_size]}, "tokens"),
            ("/detokenize", {"tokens": [-1]}, "tokens"),
            ("/detokenize", {}, "tokens"),
        ]:
            response = http.post(path, json=body)
            assert response.status_code == 400, (path, body, response.text)
            assert (response.json()["error"]["param"] or "").split(".")[0] == param, response.text
        other = http.post("/tokenize", json={"model": "gpt-4o", "prompt": "x"})
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
        assert http.get("/version").json() == {"version": kvscope.__version__}
