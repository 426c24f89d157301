"""A trained model through the real server: SmolLM2-135M-Instruct (the named GGUF model) answers a chat
request with its own template and tokenizer, streaming and not, and stops at its end-of-turn token.

``graphburst serve --http --model smollm2-135m --draft ngram`` runs in a subprocess on the CPU
(numpy backend, fp32); the openai client talks to it. The reply must be the model's greedy
answer, which transformers gives for the same file and the same rendered prompt.
"""

from __future__ import annotations

import pytest

from test_http_server import ServerProcess

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."
# Loading the GGUF (dequantizing 272 tensors) and building its tokenizer take ~15 s on a small CPU.
START_S = 180.0


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--model", "smollm2-135m", "--draft", "ngram", "--batch", "2", "-k", "4", "-m", "4",
                      "--capacity", "512", start_timeout=START_S)
    yield s
    assert s.terminate() == 0, s.errors()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_chat_answers_with_the_models_own_template(client):
    reply = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=32)
    choice = reply.choices[0]
    assert choice.message.content == ANSWER
    assert choice.finish_reason == "stop"  # <|im_end|> (eos id 2) ended it, well before max_tokens
    assert reply.usage.completion_tokens == 8  # 7 answer tokens and the end-of-turn token
    assert reply.usage.prompt_tokens == 37  # ChatML: the template's system turn, the question, the assistant header


def test_chat_streams_the_same_answer(client):
    stream = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=32, stream=True)
    parts, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == ANSWER and finish == "stop"


def test_completions_text_prompt(client):
    # the plain route takes text through the same tokenizer (no template): a deterministic continuation
    reply = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=4)
    assert reply.choices[0].text.startswith(" Paris")
