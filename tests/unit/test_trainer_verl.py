"""veRL's path through the search environment (`plugsearch.trainer.verl.agent_loop`, `plugsearch.trainer.verl.reward`), against a
fake of veRL 0.9.1's server manager: the same documents as the service and TRL paths (the two-block case),
the ids trained on are the ids the server sampled, and the reward reads the environment's documents, never
the text. Runs without veRL; where veRL is installed (the check venv) the same tests run on its classes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from omegaconf import OmegaConf

from plugsearch.common.schemas.base import Document
from plugsearch.searcher.env import PolicyCall
from plugsearch.searcher.prompts import PromptSet
from plugsearch.trainer.common.rewards import RewardComputer
from plugsearch.trainer.common.upstreams import Answered
from plugsearch.trainer.verl import reward
from plugsearch.trainer.verl.agent_loop import OUTCOME_FIELD, PlugsearchAgentLoop, ServerSampler
from tests.support.chat_policy import run_search
from tests.unit.test_searcher_loop import ScriptedPolicy, s3
from tests.unit.test_trainer_episode import PARAMS, TWO_BLOCKS, Blocks

SEARCH = {"mode": PARAMS.mode, "max_turns": PARAMS.max_turns, "retrieve_k": PARAMS.retrieve_k,
          "select_k": PARAMS.select_k}


@pytest.fixture(scope="module")
def tokenizer(var_dir: Path) -> Any:
    from plugsearch.trainer.llm.model import default_policy_path, load_tokenizer

    return load_tokenizer(default_policy_path(var_dir))


def token_output(**fields: Any) -> Any:
    """veRL's `TokenOutput` where installed, else an object with its fields."""
    try:
        from verl.workers.rollout.replica import TokenOutput
    except ImportError:
        return SimpleNamespace(**{"log_probs": None, "stop_reason": None, **fields})
    return TokenOutput(**fields)


class FakeServerManager:
    """veRL 0.9.1's `LLMServerClient.generate(request_id, *, prompt_ids, sampling_params, ...)`: answers each
    call with the next scripted text as token ids (and end of turn with `eos`)."""

    def __init__(self, tokenizer: Any, script: Sequence[str], *, eos: bool = False) -> None:
        self.tokenizer = tokenizer
        self.script = list(script)
        self.eos = eos
        self.calls: list[dict[str, Any]] = []
        self.sampled: list[list[int]] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, **kwargs: Any) -> Any:
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids),
                           "sampling_params": dict(sampling_params)})
        text = self.script[len(self.calls) - 1]
        ids = [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        if self.eos:
            ids.append(int(self.tokenizer.eos_token_id))
        self.sampled.append(ids)
        logprobs = [-0.25] * len(ids) if sampling_params.get("logprobs") else None
        return token_output(token_ids=ids, log_probs=logprobs, stop_reason="completed")


def agent_loop(tokenizer: Any, server: FakeServerManager, *, prompt_length: int = 4096,
               response_length: int = 4096, search: dict[str, Any] | None = None,
               retriever: Any = None) -> PlugsearchAgentLoop:
    """Built the way veRL's `AgentLoopWorker` builds it (hydra kwargs: the registry entry and the yaml's);
    `retriever` defaults to the two-block fake (`"service"`: the retriever service of the TRAINER_* settings)."""
    config = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"name": "vllm", "prompt_length": prompt_length,
                                          "response_length": response_length, "max_model_len": None}},
        "data": {"apply_chat_template_kwargs": {}}})
    try:
        from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    except ImportError:
        DictConfigWrap = SimpleNamespace  # noqa: N806 - stands in for veRL's class
    return PlugsearchAgentLoop(
        trainer_config=DictConfigWrap(config=config), server_manager=server, tokenizer=tokenizer, processor=None,
        dataset_cls=None, data_config=DictConfigWrap(config=config.data), name="plugsearch_s3",
        search=OmegaConf.create(search or SEARCH), prompts_dir=None,
        retriever=None if retriever == "service" else (retriever or Blocks()))


VERL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
"""What veRL's `AgentLoopWorker.generate_sequences` passes to `run` (training, calculate_log_probs on)."""


def row(question: str = "A", **extra: Any) -> dict[str, Any]:
    """The dataset fields veRL hands to `run` (`plugsearch.trainer.verl.data` rows)."""
    return {"raw_prompt": [{"role": "user", "content": question}], "data_source": "nq", "agent_name": "plugsearch_s3",
            "reward_model": {"style": "rule", "ground_truth": ["gold"]}, "index": 0,
            "extra_info": {"question": question, "id": "nq-1", "index": 0,
                           "prompt_version": PromptSet.packaged().version, **extra}}


async def run(loop: PlugsearchAgentLoop, question: str = "A", sampling: dict[str, Any] | None = None) -> Any:
    return await loop.run(dict(sampling or VERL_SAMPLING), **row(question))


class RecordingServices:
    """`QAServices` that records the documents the frozen generator is given."""

    def __init__(self) -> None:
        self.generator_saw: list[list[str]] = []

    async def retrieve(self, queries: Sequence[str], k: int, method: Any) -> list[list[Document]]:
        return await Blocks().retrieve(list(queries), k, method)

    async def answer_and_judge(self, items: Sequence[tuple[str, Sequence[Document], Sequence[str]]]
                               ) -> list[Answered]:
        self.generator_saw += [[d.id for d in docs] for _, docs, _ in items]
        return [Answered("answer", 1.0, 0.0, 0.5, "span") for _ in items]


# ------------------------------------------------------------------------------------ the two blocks
async def test_two_blocks_give_the_service_documents_on_the_verl_path(tokenizer: Any) -> None:
    """Blocks [A1, A2] and [B1, B2] marked [2] then [1]: the service returns [A2, B1], and veRL's rollout
    hands the reward, and the reward hands the frozen generator, [A2, B1] as well."""
    service = await run_search("A", PARAMS, policy=ScriptedPolicy(TWO_BLOCKS), retriever=Blocks())
    assert [d.id for d in service.documents] == ["A-2", "B-1"]

    output = await run(agent_loop(tokenizer, FakeServerManager(tokenizer, TWO_BLOCKS)))
    outcome = output.extra_fields[OUTCOME_FIELD]
    assert [d["id"] for d in outcome["documents"]] == ["A-2", "B-1"]
    assert outcome["stop_reason"] == "complete" and outcome["valid_actions"] == 2

    services = RecordingServices()
    scorer = reward.BatchScorer(RewardComputer(services, kind="genacc"), gather_s=0.0)
    fields = row()
    # what veRL's naive reward manager passes: the agent loop's extra_fields merged into extra_info; the
    # decoded response is ignored, even when its text would select other documents
    extra_info = {**fields["extra_info"], **output.extra_fields}
    scored = await reward.compute_score(data_source="nq", solution_str="<important_info>[1, 2]</important_info>",
                                        ground_truth=fields["reward_model"]["ground_truth"], extra_info=extra_info,
                                        scorer=scorer)
    assert services.generator_saw == [["A-2", "B-1"]]
    assert scored["score"] == 1.0 and scored["documents"] == 2.0 and scored["format"] == 1.0


@pytest.mark.parametrize("eos", [False, True])
async def test_verl_trains_on_the_ids_the_server_sampled(tokenizer: Any, eos: bool) -> None:
    server = FakeServerManager(tokenizer, TWO_BLOCKS, eos=eos)
    output = await run(agent_loop(tokenizer, server))
    mask = output.response_mask
    assert len(output.response_ids) == len(mask) == len(output.response_logprobs)
    assert [t for t, m in zip(output.response_ids, mask, strict=True) if m] == [t for s in server.sampled for t in s]
    assert all(lp == 0.0 for lp, m in zip(output.response_logprobs, mask, strict=True) if not m)
    # every call continued the exact ids so far, from veRL's prompt, with one request id (sticky server)
    assert server.calls[0]["prompt_ids"] == output.prompt_ids
    second = server.calls[1]["prompt_ids"]
    assert second == output.prompt_ids + output.response_ids[:len(second) - len(output.prompt_ids)]
    assert len({c["request_id"] for c in server.calls}) == 1
    # the environment's information block is in the mask-0 part
    inserted = tokenizer.decode([t for t, m in zip(output.response_ids, mask, strict=True) if not m])
    assert "text 1 of B" in inserted and "<information>" in inserted
    # the prompt is the environment's first observation (question + naive top-k), s3's tag format
    prompt = tokenizer.decode(output.prompt_ids)
    assert "<query>" in prompt and "text 2 of A" in prompt and "tool_call" not in prompt
    params = server.calls[0]["sampling_params"]
    assert params["stop"] == ["</query>"] and params["include_stop_str_in_output"] is True
    assert params["temperature"] == 1.0 and params["max_tokens"] == PARAMS.max_new_tokens
    assert output.num_turns == len(output.extra_fields[OUTCOME_FIELD]["blocks"]) + 3  # system, user x2, assistant x2


async def test_logprobs_only_when_verl_asks(tokenizer: Any) -> None:
    output = await run(agent_loop(tokenizer, FakeServerManager(tokenizer, TWO_BLOCKS)),
                       sampling={**VERL_SAMPLING, "logprobs": False})
    assert output.response_logprobs is None


async def test_response_is_cut_at_response_length_but_the_search_runs_to_its_end(tokenizer: Any) -> None:
    output = await run(agent_loop(tokenizer, FakeServerManager(tokenizer, TWO_BLOCKS), response_length=12))
    assert len(output.response_ids) == len(output.response_mask) == 12
    assert [d["id"] for d in output.extra_fields[OUTCOME_FIELD]["documents"]] == ["A-2", "B-1"]


async def test_a_prompt_longer_than_verls_prompt_length_is_an_error(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="prompt_length"):
        await run(agent_loop(tokenizer, FakeServerManager(tokenizer, TWO_BLOCKS), prompt_length=16))


async def test_rows_built_with_other_prompts_are_refused(tokenizer: Any) -> None:
    loop = agent_loop(tokenizer, FakeServerManager(tokenizer, TWO_BLOCKS))
    with pytest.raises(ValueError, match="prompt set"):
        await loop.run(dict(VERL_SAMPLING), **row(prompt_version="other-00000000"))
    with pytest.raises(ValueError, match="question"):
        await loop.run(dict(VERL_SAMPLING), **{**row(), "extra_info": {"id": "x"}})


def test_constrained_decoding_is_refused_up_front(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="constrained"):
        agent_loop(tokenizer, FakeServerManager(tokenizer, []), search={**SEARCH, "constrained": True})


# ------------------------------------------------------------------------------------------ sampler
async def test_sampler_keeps_verls_settings_and_caps_the_budget_at_the_context(tokenizer: Any) -> None:
    server = FakeServerManager(tokenizer, [s3("B")])
    call = PolicyCall(stop=["</query>"], max_tokens=160, temperature=0.0)
    sampler = ServerSampler(server, tokenizer, {**VERL_SAMPLING, "max_tokens": 9999}, max_model_len=100)
    out = await sampler.sample(list(range(40)), call)
    params = server.calls[0]["sampling_params"]
    assert params["max_tokens"] == 60 and params["temperature"] == 1.0 and params["top_k"] == -1
    assert out.stopped and out.text.endswith("</query>") and out.ids == server.sampled[0]
    assert out.logprobs == [-0.25] * len(out.ids)
    # no room left: no request, an empty output (an invalid action for the environment)
    full = await sampler.sample(list(range(100)), call)
    assert full.ids == [] and not full.stopped and len(server.calls) == 1
    sglang = ServerSampler(server, tokenizer, VERL_SAMPLING, engine="sglang").request([1], call)
    assert sglang is not None and sglang["max_new_tokens"] == 160 and sglang["no_stop_trim"] is True
    assert "max_tokens" not in sglang


async def test_a_stop_string_not_reached_is_not_stopped(tokenizer: Any) -> None:
    server = FakeServerManager(tokenizer, ['<query>{"query": "unfinish'])
    out = await ServerSampler(server, tokenizer, VERL_SAMPLING).sample([1, 2], PolicyCall(["</query>"], 8, 1.0))
    assert not out.stopped


# ------------------------------------------------------------------------------------------- reward
def test_reward_refuses_a_trajectory_without_the_environments_outcome() -> None:
    with pytest.raises(ValueError, match="agent loop"):
        reward.trajectory("nq", ["gold"], {"question": "q", "id": "1"})
    assert reward.gold_answers({"target": ["x", "y"]}) == ["x", "y"] and reward.gold_answers("z") == ["z"]


async def test_concurrent_rewards_go_out_as_one_batch(tokenizer: Any) -> None:
    output = await run(agent_loop(tokenizer, FakeServerManager(tokenizer, TWO_BLOCKS)))
    services = RecordingServices()
    scorer = reward.BatchScorer(RewardComputer(services, kind="genacc"), gather_s=0.01)
    extra_info = {**row()["extra_info"], **output.extra_fields}
    results = await asyncio.gather(*(reward.compute_score("nq", "", ["gold"], extra_info, scorer=scorer)
                                     for _ in range(3)))
    assert scorer.batches == 1 and len(services.generator_saw) == 3 and [r["score"] for r in results] == [1.0] * 3

    class Failing(RecordingServices):
        async def answer_and_judge(self, items: Sequence[tuple[str, Sequence[Document], Sequence[str]]]
                                   ) -> list[Answered]:
            raise RuntimeError("generator down")

    failing = reward.BatchScorer(RewardComputer(Failing(), kind="genacc"), gather_s=0.01)
    outcomes = await asyncio.gather(*(reward.compute_score("nq", "", ["gold"], extra_info, scorer=failing)
                                      for _ in range(2)), return_exceptions=True)
    assert all(isinstance(o, RuntimeError) for o in outcomes)


# ---------------------------------------------------------------------- with veRL's own batch and reward code
async def test_verl_batches_the_episode_and_its_reward_loop_scores_the_environments_documents(tokenizer: Any) -> None:
    """Where veRL is installed (the check venv, the image): its AgentLoopWorker pads the output into the
    training batch, and its reward loop (`_compute_score` -> naive reward manager -> our async function)
    scores the documents of the environment's state."""
    pytest.importorskip("verl")
    from functools import partial

    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

    output = await run(agent_loop(tokenizer, FakeServerManager(tokenizer, TWO_BLOCKS)))
    services = RecordingServices()
    scorer = reward.BatchScorer(RewardComputer(services, kind="genacc"), gather_s=0.0)
    manager = NaiveRewardManager(OmegaConf.create({}), tokenizer, partial(reward.compute_score, scorer=scorer))
    worker = object.__new__(AgentLoopWorker)  # only the state its post-processing reads
    worker.tokenizer, worker.processor, worker.distillation_enabled, worker.mm_processor_kwargs = tokenizer, None, False, {}
    worker.rollout_config = SimpleNamespace(prompt_length=4096, response_length=4096)
    worker.reward_loop_worker_handles = [SimpleNamespace(compute_score=SimpleNamespace(remote=manager.run_single))]

    internal = await worker._agent_loop_postprocess(output, False, **row())
    batch = worker._postprocess([internal])
    assert services.generator_saw == [["A-2", "B-1"]]
    assert internal.reward_score == 1.0 and float(batch.batch["rm_scores"].sum()) == 1.0
    assert int(batch.batch["response_mask"].sum()) == sum(output.response_mask)
    assert [d["id"] for d in batch.non_tensor_batch[OUTCOME_FIELD][0]["documents"]] == ["A-2", "B-1"]


# --------------------------------------------------------------------------------------------- config
def verl_config() -> Any:
    from plugsearch.trainer.verl import CONFIG_DIR

    return OmegaConf.load(CONFIG_DIR / "s3_grpo.yaml")


@pytest.mark.parametrize(("nnodes", "gpus"), [(1, 1), (1, 8), (2, 8)])
def test_config_batch_arithmetic_holds_on_one_eight_and_sixteen_gpus(nnodes: int, gpus: int) -> None:
    """Mirrors veRL 0.9.1's batch checks (validate_config and the workers' asserts, quoted in
    `check_config.batch_problems`); `python -m plugsearch.trainer.verl.check_config` runs veRL's own code on top."""
    from plugsearch.trainer.verl.check_config import batch_problems

    assert batch_problems(verl_config(), nnodes=nnodes, gpus_per_node=gpus) == []


def test_the_old_config_fails_the_mirrored_checks() -> None:
    """The issue's numbers: mini-batch 60 x n 5 over 8 GPUs is 37.5 per GPU; rollout TP 2 on one GPU."""
    from plugsearch.trainer.verl.check_config import batch_problems

    config = verl_config()
    config.data.train_batch_size = 120
    config.actor_rollout_ref.actor.ppo_mini_batch_size = 60
    config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 4
    config.actor_rollout_ref.rollout.tensor_model_parallel_size = 2
    assert any("300 not divisible by data-parallel size 8" in p for p in batch_problems(config, nnodes=1,
                                                                                         gpus_per_node=8))
    assert any("rollout engine" in p for p in batch_problems(config, nnodes=1, gpus_per_node=1))
    assert any("600 not divisible by 16" in p for p in batch_problems(config, nnodes=2, gpus_per_node=8))


def test_config_runs_our_agent_loop_and_reward(monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    import yaml

    from plugsearch.trainer.verl import CONFIG_DIR

    config = verl_config()
    rollout = config.actor_rollout_ref.rollout
    assert rollout.multi_turn.enable is False  # the turns are the search environment's, not a tool loop
    monkeypatch.setenv("PLUGSEARCH_VERL_DIR", str(CONFIG_DIR))
    registry = yaml.safe_load(Path(rollout.agent.agent_loop_config_path).read_text())
    entries = {e["name"]: e for e in registry}
    assert rollout.agent.default_agent_loop in entries
    for entry in entries.values():  # each entry builds with veRL's kwargs
        module, _, name = entry["_target_"].rpartition(".")
        assert getattr(__import__(module, fromlist=[name]), name) is PlugsearchAgentLoop
    assert config.reward.custom_reward_function.path == "pkg://plugsearch.trainer.verl.reward"
    assert inspect.iscoroutinefunction(getattr(reward, config.reward.custom_reward_function.name))
    assert config.data.max_prompt_length + config.data.max_response_length <= rollout.max_model_len
    assert config.actor_rollout_ref.model.path  # resolves with or without POLICY_MODEL


# ----------------------------------------------------------------------------------------------- data
def qa_dir(tmp_path: Path, sizes: dict[str, int]) -> Path:
    import json

    (tmp_path / "qa").mkdir()
    for name, n in sizes.items():
        lines = [json.dumps({"id": f"{name}-{i}", "question": f"{name} question {i}?",
                             "golden_answers": [f"answer {i}"]}) for i in range(n)]
        (tmp_path / "qa" / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_parquet_rows_are_verls_format_with_the_environments_prompt(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from plugsearch.common.schemas.searcher import SearchParams
    from plugsearch.trainer.verl.data import agent_search_params, build, first_messages

    data = qa_dir(tmp_path, {"nq": 205, "hotpotqa": 203})
    summary = build(data, tmp_path / "out", val_per_dataset=2)
    train = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    val = pq.read_table(tmp_path / "out" / "val.parquet").to_pylist()
    # the first 200 of each file (evaluation questions, then reserved ones) are never trained on; val comes
    # from the evaluation questions
    assert [r["extra_info"]["id"] for r in train] == ["nq-200", "hotpotqa-200", "nq-201", "hotpotqa-201",
                                                      "nq-202", "hotpotqa-202", "nq-203", "nq-204"]
    assert [r["extra_info"]["id"] for r in val] == ["nq-0", "nq-1", "hotpotqa-0", "hotpotqa-1"]
    assert summary["train"] == 8 and summary["val"] == 4
    first = train[0]
    assert first["agent_name"] == "plugsearch_s3" and first["data_source"] == "nq"
    assert first["reward_model"] == {"style": "rule", "ground_truth": ["answer 200"]}
    assert first["extra_info"]["question"] == "nq question 200?" and first["extra_info"]["index"] == 0
    assert first["extra_info"]["prompt_version"] == PromptSet.packaged().version
    # the prompt is the environment's own first observation (s3 tags), with the agent loop's setting
    params = agent_search_params()["plugsearch_s3"]
    assert params == SearchParams(mode="s3", max_turns=3, retrieve_k=8, select_k=3, max_new_tokens=160)
    assert first["prompt"] == first_messages("nq question 200?", params, PromptSet.packaged())
    assert "<query>" in first["prompt"][0]["content"] and "tool" not in first["prompt"][0]["content"]
    assert "nq question 200?" in first["prompt"][1]["content"]


def test_parquet_s3_filter_and_refusals(tmp_path: Path) -> None:
    from plugsearch.trainer.verl.data import build, main

    data = qa_dir(tmp_path, {"nq": 203, "hotpotqa": 201})
    baselines = {"nq-200": 0.0, "nq-201": 1.0, "nq-202": 0.0, "hotpotqa-200": 0.0}
    summary = build(data, tmp_path / "out", val_per_dataset=1, baselines=baselines)
    assert summary["train"] == 3 and summary["train_candidates"] == 4
    with pytest.raises(ValueError, match="held out"):
        build(data, tmp_path / "out", val_per_dataset=201)
    summary = main(["--out", str(tmp_path / "cli"), "--data-dir", str(data), "--agent", "plugsearch_qagent",
                    "--val-per-dataset", "1"])
    assert summary["agent"] == "plugsearch_qagent" and (tmp_path / "cli" / "train.parquet").is_file()


def test_verls_dataset_reads_the_parquet(tmp_path: Path, tokenizer: Any) -> None:
    """Where veRL is installed: its RLHFDataset loads the rows and hands the agent loop what it reads."""
    pytest.importorskip("verl")
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from plugsearch.trainer.verl.data import build

    build(qa_dir(tmp_path, {"nq": 202}), tmp_path / "out", datasets=["nq"], val_per_dataset=1)
    data = verl_config().data
    dataset = RLHFDataset(data_files=[str(tmp_path / "out" / "train.parquet")], tokenizer=tokenizer,
                          config=OmegaConf.create({k: data[k] for k in ("prompt_key", "max_prompt_length",
                                                                        "filter_overlong_prompts", "truncation")}))
    assert len(dataset) == 2
    sample = dataset[0]
    assert sample["agent_name"] == "plugsearch_s3" and sample["index"] == 0
    assert sample["extra_info"]["question"] == "nq question 100?"
    assert sample["raw_prompt"][0]["role"] == "system"
