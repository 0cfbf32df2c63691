"""The clients people point at a server, each as it is shipped, against real specserve servers on loopback: the
OpenAI Agents SDK (one agent, one function tool, through the Responses API), LangChain's ChatOpenAI (invoke, stream,
bind_tools, with_structured_output), and lm-evaluation-harness (a multiple-choice task scored by log-likelihood
through `local-completions`, a generation task through `local-chat-completions`; tests/data/lm_eval). Each runs
against the default server (CopySpec) and the plain one, which must agree; lm-eval's log-likelihoods through a
float32 server equal its own `hf` backend's on the same weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from bench.server_process import start_server, stop_server
from tests.e2e.conftest import PLAIN_API_KEY

MODEL = "SmolLM2-135M-Instruct"
TASKS_DIR = Path(__file__).resolve().parent.parent / "data" / "lm_eval"
LOGLIKELIHOOD_TOLERANCE = 1e-3  # per choice, nats: specserve's float32 forward against transformers'


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny and 21 degrees Celsius in {city}."


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def servers(server, plain_server):
    """(API URL, key) of the default server and of the plain one."""
    return {"copyspec": (server.api_url, "unused"), "none": (plain_server.api_url, PLAIN_API_KEY)}


# ---- the OpenAI Agents SDK -----------------------------------------------------------------------------------------


def run_agent(api_url: str, api_key: str):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # traces go to OpenAI's servers: none here
    calls = []

    @function_tool
    def weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return get_weather(city)

    model = OpenAIResponsesModel(model=MODEL, openai_client=AsyncOpenAI(base_url=api_url, api_key=api_key))
    agent = Agent(name="Forecaster", instructions="You answer questions about the weather, using your tool.",
                  tools=[weather], model=model,
                  model_settings=ModelSettings(temperature=0.0, tool_choice="required", max_tokens=64,
                                               parallel_tool_calls=False))
    result = Runner.run_sync(agent, "What is the weather like in Paris?", max_turns=4)
    return calls, result


@pytest.mark.slow
def test_the_agents_sdk_runs_an_agent_with_a_function_tool_end_to_end(servers):
    """The forced first turn calls the tool; the SDK runs it, sends its output back (tool_choice reset to auto) and
    the model answers: the same run with speculation and without."""
    runs = {name: run_agent(*servers[name]) for name in ("copyspec", "none")}
    calls, result = runs["copyspec"]
    assert calls and isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert (calls, result.final_output) == (runs["none"][0], runs["none"][1].final_output)


# ---- LangChain -----------------------------------------------------------------------------------------------------


def chat_model(api_url: str, api_key: str, **kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=api_url, api_key=api_key, temperature=0.0, max_retries=0, **kwargs)


@pytest.mark.slow
def test_langchain_chat_openai_invokes_streams_calls_tools_and_structures(servers):
    answers = {}
    for name, (api_url, api_key) in servers.items():
        llm = chat_model(api_url, api_key, max_tokens=48)
        invoked = llm.invoke("Name three colours of the rainbow.").content
        streamed = "".join(chunk.content for chunk in llm.stream("Name three colours of the rainbow."))
        assert invoked and streamed == invoked
        called = llm.bind_tools([WEATHER_TOOL], tool_choice="get_weather").invoke("Weather in Rome?")
        assert [call["name"] for call in called.tool_calls] == ["get_weather"]
        assert isinstance(called.tool_calls[0]["args"].get("city"), str)
        city = chat_model(api_url, api_key, max_tokens=64).with_structured_output(City).invoke(
            "Which city is the capital of France? Give its name and country.")
        assert isinstance(city, City) and city.name
        answers[name] = (invoked, called.tool_calls[0]["args"], city)
    assert answers["copyspec"] == answers["none"]


# ---- lm-evaluation-harness ------------------------------------------------------------------------------------------


def task_configs(tmp_path: Path) -> dict[str, dict]:
    """The two tasks, their data files named by absolute path (datasets' local json builder, offline)."""
    def data(name: str) -> dict:
        return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(TASKS_DIR / name)}},
                "test_split": "test"}

    return {
        "multiple_choice": {
            "task": "specserve_multiple_choice", **data("multiple_choice.jsonl"), "output_type": "multiple_choice",
            "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}],
        },
        "generation": {
            "task": "specserve_generation", **data("generation.jsonl"), "output_type": "generate_until",
            "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 12, "do_sample": False, "temperature": 0.0},
            "metric_list": [{"metric": "exact_match", "ignore_case": True, "ignore_punctuation": True}],
        },
    }


def evaluate(model: str, model_args: dict, task: dict, **kwargs) -> tuple[dict, list]:
    """lm-eval's simple_evaluate on one task: (its metrics, its samples in document order)."""
    from lm_eval import simple_evaluate

    out = simple_evaluate(model=model, model_args=model_args, tasks=[task], batch_size=1, log_samples=True,
                          bootstrap_iters=0, **kwargs)
    name = task["task"]
    return out["results"][name], sorted(out["samples"][name], key=lambda sample: sample["doc_id"])


def tokenizer_path() -> str:
    from engine.model.gguf_cache import loadable_source  # the checkpoint the default model is served from
    from engine.model.model_source import resolve_model_source

    return loadable_source(resolve_model_source(None)).path


def completions_model_args(api_url: str, api_key: str) -> dict:
    return {"model": MODEL, "base_url": f"{api_url}/completions", "tokenizer": tokenizer_path(),
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1,
            "header": {"Authorization": f"Bearer {api_key}"}}


def loglikelihoods(samples: list) -> list[list[float]]:
    return [[choice[0] for choice in sample["filtered_resps"]] for sample in samples]


@pytest.fixture(scope="module")
def float32_server(tmp_path_factory):
    running = start_server(tmp_path_factory.mktemp("float32-server"), "--weights", "float32", "--max-num-seqs", "2")
    yield running
    stop_server(running)


@pytest.fixture
def lm_eval_offline(monkeypatch):
    """Datasets and models from local files only: nothing reaches for a hub."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.slow
def test_lm_eval_scores_a_multiple_choice_task_as_its_own_hf_backend_does(float32_server, tmp_path, lm_eval_offline):
    """Through a float32 server that speculates (CopySpec, the default), every choice's log-likelihood is lm-eval's
    own hf backend's on the same weights (engine/test_prompt_logprobs.py shows speculation changes no figure at
    all)."""
    task = task_configs(tmp_path)["multiple_choice"]
    served, served_samples = evaluate("local-completions", completions_model_args(float32_server.api_url, "x"), task,
                                      limit=4)  # 16 choices: the test budget (tests/README.md)
    reference, reference_samples = evaluate(
        "hf", {"pretrained": tokenizer_path(), "dtype": "float32", "device": "cpu"}, task, limit=4)
    got, want = loglikelihoods(served_samples), loglikelihoods(reference_samples)
    assert len(got) == 4 and all(len(choices) == 4 for choices in got)
    for item, (have, expected) in enumerate(zip(got, want)):
        assert have == pytest.approx(expected, abs=LOGLIKELIHOOD_TOLERANCE), (item, have, expected)
    assert served["acc,none"] == reference["acc,none"]


@pytest.mark.slow
def test_lm_eval_runs_a_generation_task_through_chat_completions(servers, tmp_path, lm_eval_offline):
    task = task_configs(tmp_path)["generation"]
    outputs = {}
    for name, (api_url, api_key) in servers.items():
        args = {"model": MODEL, "base_url": f"{api_url}/chat/completions", "num_concurrent": 1, "max_retries": 1,
                "header": {"Authorization": f"Bearer {api_key}"}}
        results, samples = evaluate("local-chat-completions", args, task, apply_chat_template=True, limit=2)
        assert 0.0 <= results["exact_match,none"] <= 1.0
        outputs[name] = [sample["resps"] for sample in samples]
        assert len(outputs[name]) == 2 and all(json.dumps(resp) for resp in outputs[name])
    assert outputs["copyspec"] == outputs["none"]
