"""The combination suite's cases and what runs inside the ranks (tests/distributed/test_combinations.py).

A case is one strategy and one value of each feature a user turns on together. For each
strategy, :func:`cases_for` picks the cases with the all-pairs generator (``pairwise.py``):
every pair of feature values meets in at least one case. :func:`run_cases` trains each case's
tiny diffusers transformer through the real loop and returns what the tests compare: the
losses (and those of the same case under ddp, and without block swap), the validation losses,
a run stopped at a checkpoint and resumed, and an exported model or adapter reloaded in plain
diffusers.

``fp8_base`` and ``block_swap`` run under LoRA with a strategy that shards nothing (ddp): the
config refuses them elsewhere. An fp8 base is another function (its frozen weights quantized),
so such a case's ddp reference is the same case, fp8 base included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from litegen.config.strategies import STRATEGIES, names_where
from litegen_zoo.real_models import REAL_MODELS
from tests.distributed.pairwise import Case, all_pairs
from tests.distributed.runs import full_weights

STEPS = 4  # a resumed case stops at step 2 and goes on to 4
GLOBAL_BATCH = 4
TWO_RANK_STRATEGIES = tuple(names_where(lambda row: row.min_nodes == 1))
FOUR_RANK_STRATEGIES = tuple(names_where(lambda row: row.min_nodes == 2))  # 2 nodes of 2 ranks
FEATURES: dict[str, list[Any]] = {
    "model": ["wan", "flux", "ltx_video", "sd3", "dit"],
    "ema": [False, True],
    "lora": [False, True],
    "checkpoint": ["off", "block", "ops", "auto"],
    "offload": [False, True],
    "compile": [False, True],
    "sp": [1, 2],
    "frozen_encoder": [False, True],
    "accum": [1, 2],
    "hooks": ["none", "same_step", "different_steps"],
    "resume": [False, True],
    "export": [False, True],
    "fp8_base": [None, "rowwise"],
    "block_swap": [False, True],
}
# Models whose attention has a sequence-parallel plan (docs/sequence_parallel.md).
SP_MODELS = {"wan", "ltx_video", "dit"}
LORA = {"rank": 4, "alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}
# Features refused under every strategy that shards (litegen/config/checks.py); their first
# value is the one that leaves them off.
REPLICATED_ONLY = ("fp8_base", "block_swap")
# A block swap case keeps the first repeated block on the device and streams the others.
BLOCKS_ON_DEVICE = 1


def _off(value: Any) -> bool:
    """A feature's value when it is not used (``True == 1``: compared by type too)."""
    return (
        value is None
        or value is False
        or value in ("off", "none")
        or (type(value) is int and value == 1)
    )


HOOK_EVERY = {"none": (0, 0), "same_step": (2, 2), "different_steps": (2, 3)}  # sample, validate


def runnable(strategy: str, case: Case) -> bool:
    """Combinations that are refused before the ranks start, or have no meaning, are not cases
    (the refusals: litegen/config/checks.py)."""
    # fsdp1 has no sequence parallelism (refused); Flux and SD3 have no plan.
    if case["sp"] != 1 and (strategy == "fsdp1" or case["model"] not in SP_MODELS):
        return False
    if case["fp8_base"] is None and not case["block_swap"]:
        return True
    # Both act on whole frozen LoRA base weights: refused where a strategy shards anything.
    if not case["lora"] or STRATEGIES[strategy].shards:
        return False
    # Block swap and activation offload both take saved tensors over; compiled blocks would
    # recompile for each swap (refused).
    return not (case["block_swap"] and (case["offload"] or case["compile"]))


def features_for(strategy: str) -> dict[str, list[Any]]:
    """:data:`FEATURES` less the values ``strategy`` never runs: under a strategy that shards,
    fp8_base and block_swap stay off. Every case with such a value fails :func:`runnable` too;
    leaving them out spares the all-pairs search from proving that pair by pair."""
    if not STRATEGIES[strategy].shards:
        return FEATURES
    return FEATURES | {name: FEATURES[name][:1] for name in REPLICATED_ONLY}


def cases_for(strategy: str) -> list[Case]:
    """The all-pairs cases of ``strategy``, each with its ``strategy`` key."""
    chosen = all_pairs(features_for(strategy), lambda case: runnable(strategy, case))
    return [{"strategy": strategy} | case for case in chosen]


def sample_cases(matrix: dict[str, list[Case]], strategies: tuple[str, ...]) -> list[Case]:
    """CI's sample: for each strategy, the uncompiled case that switches on the most features
    the sample has not switched on yet (then the most features). Compile is left to the matrix: Dynamo's tracing of the
    blocks takes about a minute a case on 2 CPU cores (test_compile_strategies.py and
    test_real_models.py compile in CI)."""
    sample: list[Case] = []
    seen: set[str] = set()  # the features the sample has switched on

    def switched_on(case: Case) -> set[str]:
        return {k for k, v in case.items() if k != "strategy" and not _off(v)}

    for strategy in strategies:
        eager = [c for c in matrix[strategy] if not c["compile"]]
        best = max(eager, key=lambda c: (len(switched_on(c) - seen), len(switched_on(c))))
        sample.append(best)
        seen |= switched_on(best)
    return sample


def case_id(case: Case) -> str:
    """A readable test id: the strategy, the model and the features switched on."""
    parts = [case["strategy"], case["model"]]
    for name, value in case.items():
        if name in ("strategy", "model") or _off(value):
            continue
        parts.append(name if value is True else f"{name}={value}")
    return "-".join(parts)


# -- inside the ranks ---------------------------------------------------------------------------
class FrozenEncoder(nn.Module):
    """A stand-in VAE passed to ``prepare`` beside the trained model: never trained, it scales
    the latents before the loss (``encode``), as a user's VAE encodes images."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((8,), 0.5), requires_grad=False)

    def encode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents * self.scale.mean()


class SampleDataset(torch.utils.data.Dataset):
    """The samples of one synthetic batch of ``name``'s tiny config (dicts of tensors)."""

    collate_fn = staticmethod(torch.utils.data.default_collate)

    def __init__(self, name: str, n: int, seed: int = 1) -> None:
        self.batch = REAL_MODELS[name].batch("tiny", batch_size=n, seed=seed)

    def __len__(self) -> int:
        return len(self.batch["latents"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.batch.items()}


def config_for(case: Case, results: str, strategy: str, max_steps: int, **trainer: Any):
    from litegen.utils.config import MainConfig

    memory: dict[str, Any] = {"activation_offload": case["offload"]}
    if case["block_swap"]:
        memory["block_swap"] = {"blocks_on_device": BLOCKS_ON_DEVICE}
    if case["checkpoint"] != "off":
        ratio = "auto" if case["checkpoint"] == "auto" else 0.0
        policy = "ops" if case["checkpoint"] == "ops" else "block"
        memory["activation_checkpoint"] = {"enabled": True, "selective_ratio": ratio}
        memory["activation_checkpoint"]["policy"] = policy
        if ratio == "auto":  # a budget no block fits: the planner checkpoints every block
            memory["activation_checkpoint"]["memory_budget_gib"] = 1e-4
    sample_every, validate_every = HOOK_EVERY[case["hooks"]]
    optimization = {
        "parallel": {"strategy": strategy, "sp_size": case["sp"]},
        "memory": memory,
        "compile": {"enabled": case["compile"]},
    }
    if case["lora"]:
        optimization["lora"] = LORA | {"fp8_base": case["fp8_base"]}
    return MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": results,
            "checkpoint_dir": f"{results}/ckpt",
            # hsdp's 4 ranks need 8 samples a step to accumulate 2 micro-batches.
            "global_batch_size": GLOBAL_BATCH
            * (2 if case["strategy"] in FOUR_RANK_STRATEGIES else 1),
            "max_steps": max_steps,
            "ema": {"enable": case["ema"], "decay": 0.9},
            "optimization": optimization,
            "trainer": {
                "log_every": 1,
                "save_final": False,
                "grad_accum_steps": case["accum"],
                "sample_every": sample_every,
                "validate_every": validate_every,
            }
            | trainer,
        }
    )


def train(case: Case, results: str, strategy: str, max_steps: int = STEPS, **trainer) -> dict:
    """One run of ``case`` through the real loop: losses, validation losses, weights, exports."""
    import litegen
    from litegen.precision.fp8_weights import FP8Linear
    from litegen.trainer import Trainer

    spec = REAL_MODELS[case["model"]]
    gen = litegen.initialize(config_for(case, results, strategy, max_steps, **trainer))
    model = spec.build("tiny")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dataset = SampleDataset(case["model"], 16)
    if case["frozen_encoder"]:
        model, optimizer, encoder, loader = gen.prepare(model, optimizer, FrozenEncoder(), dataset)
    else:
        (model, optimizer, loader), encoder = gen.prepare(model, optimizer, dataset), None
    held_out = REAL_MODELS[case["model"]].batch("tiny", batch_size=2, seed=7)

    def train_step(batch, model):
        if encoder is not None:
            with torch.no_grad():
                batch = batch | {"latents": encoder.encode(batch["latents"])}
        return spec.loss(model, batch)

    def sample(model):
        images = spec.predict(model, held_out).reshape(2, -1)[:, :16]
        return images.reshape(2, 1, 4, 4).tanh()

    def validate(model):
        return spec.loss(model, held_out)

    parts = {"model": model, "optimizer": optimizer, "loader": loader}
    trainer_ = Trainer(gen, train_step, parts, sample_fn=sample, validate_fn=validate)
    losses = trainer_.fit()
    # Rank 0 writes the records and samples; the tests read rank 0's results.
    metrics = Path(results) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.open()] if gen.is_main_process else []
    out = {
        "losses": losses,
        "val_losses": {r["step"]: r["val_loss"] for r in records if "val_loss" in r},
        "samples": sorted(p.name for p in (Path(results) / "samples").glob("step_*")),
        "state": full_weights(gen, model),
        "encoder_plain": encoder is None or type(encoder) is FrozenEncoder,
        # That the memory features took effect: blocks fetched, frozen Linears stored in fp8.
        "swap_fetches": swap.stats.fetches if (swap := _trained(gen).memory.block_swap) else 0,
        "fp8_layers": sum(type(m) is FP8Linear for m in gen.unwrap(model).modules()),
    }
    if case["export"] and max_steps == STEPS:
        out["export_diff"] = _export_diff(gen, model, case, Path(results), held_out)
    return out


def _trained(gen) -> Any:
    """The prepared entry of the trained model (the frozen encoder is the other one)."""
    return next(entry for entry in gen.models if entry.trainable)


def _export_diff(gen, model, case: Case, folder: Path, batch: dict) -> float:
    """The largest difference between the trained model's prediction and those of the exports
    reloaded in plain diffusers and peft (rank 0; the other ranks return 0): a diffusers folder,
    or LoRA adapters as diffusers' file (models with ``load_lora_adapter``) and a peft folder."""
    from peft import PeftModel

    from litegen.lora import apply_lora

    spec = REAL_MODELS[case["model"]]
    state = full_weights(gen, model)
    if case["lora"]:
        adapter = gen.save_model(output_folder=str(folder), filename="adapter.lora.safetensors")
        peft_folder = gen.save_lora_peft(folder / "adapter.peft")
    else:
        exported = gen.save_diffusers(folder / "diffusers", ema=False)
    if not gen.is_main_process:
        return 0.0
    trained = spec.build("tiny")  # seed 0: the base weights the run started from
    loaded = []
    if case["lora"]:
        trained = apply_lora(trained, gen.config.optimization.lora)
        if hasattr(spec.model_class(), "load_lora_adapter"):
            loaded.append(spec.build("tiny"))
            loaded[-1].load_lora_adapter(str(adapter), prefix="transformer")
        loaded.append(PeftModel.from_pretrained(spec.build("tiny"), str(peft_folder)).base_model)
    else:
        loaded.append(spec.model_class().from_pretrained(str(exported)))
    if case["fp8_base"] is None:
        trained.load_state_dict(state)
    else:  # adapters only are exported, for the base the run quantized: load them over it
        missing, _ = trained.load_state_dict(
            {k: v for k, v in state.items() if "lora_" in k}, strict=False
        )
        assert not [k for k in missing if "lora_" in k], missing
    with torch.no_grad():
        expected = spec.predict(trained.eval(), batch)
        return max((spec.predict(m.eval(), batch) - expected).abs().max().item() for m in loaded)


def run_case(case: Case, root: str) -> dict:
    """The case under its strategy and under ddp, without block swap if it swaps, and stopped
    at step 2 then resumed; ``root`` is a folder every rank shares (run checkpoints are written
    by all of them)."""
    out = {"run": train(case, f"{root}/run", case["strategy"])}
    if case["strategy"] != "ddp":  # on the same ranks: hsdp's 4 compare with ddp's 4
        out["ddp"] = train(case, f"{root}/ddp", "ddp")
    if case["block_swap"]:  # the same run with every weight on the device
        out["unswapped"] = train(
            case | {"block_swap": False}, f"{root}/unswapped", case["strategy"]
        )
    if case["resume"]:
        first = train(case, f"{root}/resumed", case["strategy"], 2, checkpoint_every=2)
        second = train(case, f"{root}/resumed", case["strategy"], resume_run=f"{root}/resumed/ckpt")
        out["resumed"] = {"losses": first["losses"] + second["losses"], "state": second["state"]}
    return out


def run_cases(cases: list[Case], root: str) -> dict[str, Any]:
    """Each case's results, or the error it raised (so one failing case fails one test).

    Compile uses the ``aot_eager`` backend: inductor would build C++ kernels for minutes on a
    CI CPU; aot_eager runs the same Dynamo graphs and AOTAutograd split (test_real_models.py).
    """
    import torch._dynamo

    import litegen.compile

    real = litegen.compile.compile_blocks
    litegen.compile.compile_blocks = lambda model, cfg, **kw: real(
        model, cfg, **(kw | {"backend": "aot_eager"})
    )
    results: dict[str, Any] = {}
    for case in cases:
        torch._dynamo.reset()
        try:
            results[case_id(case)] = run_case(case, f"{root}/{case_id(case)}")
        except Exception as err:
            results[case_id(case)] = f"{type(err).__name__}: {err}"
    return results
