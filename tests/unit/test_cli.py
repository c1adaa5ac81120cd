"""The `litegen` command: recipes, overrides, errors, torchrun arguments, SLURM, fast start."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from litegen.config import MainConfig
from litegen_cli import commands, launcher
from litegen_cli.app import COMMANDS, app
from litegen_cli.launcher import (
    LaunchFailed,
    RankFailure,
    _summarize,
    allocator_conf,
    torchrun_args,
    write_resolved_recipe,
)
from litegen_cli.lifeline import LAUNCHER_PID_ENV
from litegen_cli.recipe import LaunchSpec, RecipeError, apply_overrides, load_recipe
from litegen_cli.run_shape import derive_run_shape
from litegen_cli.slurm import apply_slurm_env, first_host
from tests.unit.test_cli_manners import registered_commands

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ENTRY = FIXTURES / "tiny_entry.py"
runner = CliRunner()
# The smallest entry module that keeps the contract (checked before launch: entry_check.py).
MINIMAL_ENTRY = "def build(config):\n    return {}\n\n\ndef train_step(batch):\n    return 0\n"
WIDE = {"COLUMNS": "250"}  # rich wraps at 80 columns otherwise


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch):
    """Tests run the same inside a SLURM allocation: no job unless a test sets one."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def write_recipe(tmp_path: Path, text: str | None = None, **extra) -> Path:
    """A small valid recipe in tmp_path; ``extra`` top-level keys replace the defaults."""
    if text is None:
        data = {
            "launch": {"entry": str(ENTRY), "nproc_per_node": 2},
            "exp_name": "tiny",
            "results_dir": str(tmp_path / "results"),
            "runtime": {"device": "cpu"},
            "max_steps": 3,
            "global_batch_size": 8,
            "trainer": {"grad_accum_steps": 2, "log_every": 1},
            "my_model": {"depth": 2},
        }
        data.update(extra)
        text = yaml.safe_dump(data)
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args], env=WIDE)


# ----------------------------------------------------------------------------- inspect-config


def test_inspect_config_prints_tree_and_plan(tmp_path):
    result = invoke("inspect-config", write_recipe(tmp_path))
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("launch", "nproc_per_node: 2", "exp_name: 'tiny'", "my_model", "depth: 2"):
        assert text in out
    assert "strategy: 'ddp'" in out
    # 2 ranks, 8 samples, 2 accumulation steps -> 2 per rank per micro-step.
    assert "world size" in out and "2 (nproc_per_node * nnodes)" in out
    assert "per-rank micro batch" in out and "2 (global / (dp * grad_accum))" in out
    assert "device" in out and "cpu" in out


def test_inspect_config_auto_device(tmp_path):
    result = invoke("inspect-config", write_recipe(tmp_path, runtime={}))
    assert result.exit_code == 0, result.output
    assert "auto (cuda if available, else cpu)" in result.output


def test_overrides_are_applied(tmp_path):
    result = invoke(
        "inspect-config",
        write_recipe(tmp_path),
        "max_steps=7",
        "launch.nnodes=2",
        "optimization.parallel.strategy=fsdp1",
        "my_model.depth=5",
    )
    assert result.exit_code == 0, result.output
    assert "max_steps: 7" in result.output
    assert "strategy: 'fsdp1'" in result.output
    assert "depth: 5" in result.output
    assert "4 (nproc_per_node * nnodes)" in result.output


def test_override_values_are_yaml():
    data = {"a": {"b": 1}}
    problems = apply_overrides(data, ["a.b=3", "a.c=[1, 2]", "a.d=null", "e.f=text", "g=1e-4"])
    assert problems == []
    assert data == {"a": {"b": 3, "c": [1, 2], "d": None}, "e": {"f": "text"}, "g": 1e-4}


def test_override_errors_are_listed():
    data = {"lr": 0.1}
    problems = apply_overrides(data, ["noequals", "lr.x=1", "=3", "ok=[1,"])
    assert len(problems) == 4
    assert "has no '='" in problems[0]
    assert "'lr' is a float, not a section" in problems[1]
    assert "empty key" in problems[2]
    assert "not valid YAML" in problems[3]


def test_every_error_is_listed(tmp_path):
    result = invoke(
        "inspect-config",
        write_recipe(tmp_path),
        "launch.nproc_per_node=0",
        "launch.nprocs=2",
        "optimization.precision.cast_model=fp8",
        "oops",
    )
    assert result.exit_code == 2
    out = result.output
    assert "Error to load config, found the following problems:" in out
    assert "- field 'launch.nproc_per_node': Input should be greater than or equal to 1" in out
    assert "- field 'launch.nprocs': Extra inputs are not permitted" in out
    assert "- field 'optimization.precision.cast_model': Input should be" in out
    assert "override 'oops' has no '='" in out
    assert "Please check your configuration." in out
    assert "Traceback" not in out


def test_load_recipe_error_lists_launch_and_config_together(tmp_path):
    path = write_recipe(tmp_path)
    with pytest.raises(RecipeError) as info:
        load_recipe(path, ["launch.rdzv_backend=etcd", "ema.decay=2"])
    lines = str(info.value).splitlines()
    assert lines[0] == "Error to load config, found the following problems:"
    assert lines[1].startswith("  - field 'launch.rdzv_backend': Input should be 'c10d'")
    assert lines[2] == "  - field 'ema.decay': Input should be less than or equal to 1"
    assert lines[-1] == "Please check your configuration."


def test_missing_launch_entry(tmp_path):
    with pytest.raises(RecipeError, match=r"field 'launch\.entry': Field required"):
        load_recipe(write_recipe(tmp_path, "max_steps: 2\n"))


def test_missing_recipe_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    result = invoke("inspect-config", missing)
    assert result.exit_code == 2
    assert str(missing) in result.output.replace("\n", "").replace("│", "")
    assert "does not exist" in result.output
    assert "Traceback" not in result.output


def test_non_mapping_recipe(tmp_path):
    result = invoke("launch", write_recipe(tmp_path, "- just\n- a list\n"))
    assert result.exit_code == 2
    assert "holds a list, not a mapping" in result.output


def test_missing_entry_file_names_path_and_fix(tmp_path):
    path = write_recipe(tmp_path, launch={"entry": "missing_entry.py"})
    result = invoke("inspect-config", path)
    assert result.exit_code == 2
    assert str(tmp_path / "missing_entry.py") in result.output
    assert "relative to the recipe folder" in result.output


def test_missing_entry_module(tmp_path):
    with pytest.raises(RecipeError, match=r"module 'no_such_pkg_xyz\.mod' not found"):
        load_recipe(write_recipe(tmp_path, launch={"entry": "no_such_pkg_xyz.mod"}))


def test_relative_entry_resolves_against_recipe_folder(tmp_path):
    (tmp_path / "my_entry.py").write_text(MINIMAL_ENTRY)
    recipe = load_recipe(write_recipe(tmp_path, launch={"entry": "my_entry.py"}))
    assert recipe.base_dir == tmp_path
    assert recipe.launch.recipe_dir == str(tmp_path)


def test_batch_that_does_not_divide_is_an_error(tmp_path):
    result = invoke("inspect-config", write_recipe(tmp_path), "global_batch_size=6")
    assert result.exit_code == 2
    assert "field 'global_batch_size': 6 is not divisible" in result.output


def test_inspect_config_shows_the_sequence_parallel_mesh(tmp_path):
    overrides = ("optimization.parallel.sp_size=2", "trainer.tokens_per_sample=32761")
    result = invoke("inspect-config", write_recipe(tmp_path), "launch.nproc_per_node=4", *overrides)
    assert result.exit_code == 0, result.output
    out = result.output
    # 4 ranks as 2 groups of 2: each group shares its samples, 8 / (2 * 2) per micro-step.
    assert "sequence-parallel size" in out and "mesh (dp, sp)" in out and "(2, 2)" in out
    assert "2 (global / (dp * grad_accum))" in out
    assert "tokens per rank" in out and "16381 (trainer.tokens_per_sample / sp" in out


def test_inspect_config_shows_the_ulysses_times_ring_mesh(tmp_path):
    overrides = (
        "optimization.parallel.sp_size=2",
        "optimization.parallel.cp_size=2",
        "trainer.tokens_per_sample=32761",
    )
    result = invoke("inspect-config", write_recipe(tmp_path), "launch.nproc_per_node=8", *overrides)
    assert result.exit_code == 0, result.output
    out = result.output
    # 8 ranks as 2 samples' groups of 2 (ring) x 2 (Ulysses): 8 / (2 * 2) per micro-step.
    assert "mesh (dp, cp, sp)" in out and "(2, 2, 2)" in out
    assert "2 (global / (dp * grad_accum))" in out
    assert "8191 (trainer.tokens_per_sample / (sp * cp)" in out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optimization.parallel.sp_size=3"], "'optimization.parallel.sp_size': 3 does not divide"),
        (
            ["optimization.parallel.sp_size=2", "optimization.parallel.strategy=fsdp1"],
            "fsdp1 has no sequence-parallel layout",
        ),
        (
            ["optimization.parallel.sp_size=2", "optimization.parallel.cp_size=2"],
            "'optimization.parallel.cp_size': sp_size 2 * cp_size 2 = 4 does not divide the "
            "world size 2",
        ),
        (
            ["optimization.parallel.cp_size=2", "optimization.parallel.strategy=fsdp1"],
            "fsdp1 has no sequence-parallel layout for ring attention",
        ),
    ],
)
def test_bad_parallel_degrees_are_errors_before_launch(tmp_path, overrides, message):
    result = invoke("inspect-config", write_recipe(tmp_path), *overrides)
    assert result.exit_code == 2
    assert message in result.output


def test_node_rank_must_be_below_nnodes(tmp_path):
    with pytest.raises(RecipeError, match=r"'launch\.node_rank': 2 must be below nnodes"):
        load_recipe(write_recipe(tmp_path), ["launch.nnodes=2", "launch.node_rank=2"])


# ----------------------------------------------------------------------------- launcher


def test_torchrun_args_one_node():
    spec = LaunchSpec(entry="m", nproc_per_node=4)
    args = torchrun_args(spec, Path("/r/recipe.resolved.yaml"))
    assert args == [
        "--standalone",
        "--nproc_per_node", "4",
        "--max_restarts", "0",
        "--monitor_interval", "0.1",
        "-m", "litegen_cli.worker", "/r/recipe.resolved.yaml",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("optimization", "conf"),
    [
        ({}, None),
        ({"memory": {"activation_offload": True}}, "expandable_segments:True"),
        (
            {"profiles": {"frozen": {"memory": {"activation_offload": True}}}},
            "expandable_segments:True",
        ),
    ],
    ids=["no-offload", "offload", "offload-in-a-profile"],
)
def test_offload_runs_get_growable_allocator_segments(optimization, conf):
    assert allocator_conf(MainConfig.from_dict({"optimization": optimization})) == conf


@pytest.mark.parametrize("users", [None, "max_split_size_mb:512"], ids=["unset", "user-set"])
def test_the_ranks_inherit_the_allocator_setting_unless_the_user_chose_one(
    tmp_path, monkeypatch, users
):
    import torch.distributed.run

    # setenv first, so that teardown restores the variables run_ranks sets
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", users or "")
    monkeypatch.setenv(LAUNCHER_PID_ENV, "")
    if users is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    seen = []
    monkeypatch.setattr(
        torch.distributed.run,
        "run",
        lambda args: seen.append(os.environ["PYTORCH_CUDA_ALLOC_CONF"]),
    )
    path = write_recipe(tmp_path, optimization={"memory": {"activation_offload": True}})
    launcher.run_ranks(load_recipe(path), tmp_path / "resolved.yaml")
    assert seen == [users or "expandable_segments:True"]


def test_torchrun_args_two_nodes():
    spec = LaunchSpec(
        entry="m", nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="n01:29400",
        rdzv_id="job7", max_restarts=2,
    )  # fmt: skip
    args = torchrun_args(spec, Path("r.yaml"))
    assert "--standalone" not in args
    assert args[:10] == [
        "--nnodes", "2", "--node_rank", "1", "--rdzv_backend", "c10d",
        "--rdzv_endpoint", "n01:29400", "--rdzv_id", "job7",
    ]  # fmt: skip
    assert args[args.index("--max_restarts") + 1] == "2"
    assert args[args.index("--nproc_per_node") + 1] == "8"
    assert args[-3:] == ["-m", "litegen_cli.worker", "r.yaml"]


def test_torchrun_args_parse_with_torch():
    from torch.distributed.run import get_args_parser

    spec = LaunchSpec(entry="m", nnodes=2, node_rank=1, rdzv_endpoint="h:1234", rdzv_id="x")
    ns = get_args_parser().parse_args(torchrun_args(spec, Path("r.yaml")))
    assert (ns.nnodes, ns.node_rank, ns.rdzv_endpoint, ns.rdzv_id) == ("2", 1, "h:1234", "x")
    assert ns.module and ns.training_script == "litegen_cli.worker"
    assert ns.training_script_args == ["r.yaml"]


def test_resolved_recipe_round_trips(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "my_entry.py").write_text(MINIMAL_ENTRY)
    recipe = load_recipe(
        write_recipe(tmp_path / "src", launch={"entry": "my_entry.py"}), ["max_steps=9"]
    )
    resolved = write_resolved_recipe(recipe)
    assert resolved == tmp_path / "src" / "results" / "recipe.resolved.yaml"
    again = load_recipe(resolved, env={})
    # The copy lives in the results dir, yet the entry still resolves from the recipe folder.
    assert again.base_dir == tmp_path / "src"
    assert again.config.max_steps == 9
    assert again.config.to_dict() == recipe.config.to_dict()
    assert not list(resolved.parent.glob(".*.tmp"))


def test_child_failure_summary():
    err = SimpleNamespace(
        name="litegen_cli.worker",
        failures={
            1: SimpleNamespace(message={"message": "ValueError: bad"}, exitcode=1),
            0: SimpleNamespace(message="", exitcode=-9, signal_name=lambda: "SIGKILL"),
        },
    )
    summary = _summarize(err)
    assert summary.failures == [
        RankFailure(0, -9, "killed by signal SIGKILL"),
        RankFailure(1, 1, "ValueError: bad"),
    ]


def test_launch_failure_exits_1_with_summary(tmp_path, monkeypatch):
    def failing_launch(recipe):
        raise LaunchFailed("1 rank(s) of litegen_cli.worker failed", [RankFailure(0, 1, "boom")])

    monkeypatch.setattr(launcher, "launch", failing_launch)
    result = invoke("launch", write_recipe(tmp_path))
    assert result.exit_code == 1
    assert "rank 0: exit code 1: boom" in result.output
    assert "Traceback" not in result.output


# ----------------------------------------------------------------------------- SLURM


SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "3",
    "SLURM_JOB_NODELIST": "gpu[07-10]",
}


def test_slurm_env_fills_launch(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path), ["launch.rdzv_endpoint=localhost:29700"], SLURM)
    spec = recipe.launch
    assert (spec.nnodes, spec.node_rank, spec.rdzv_id) == (4, 3, "4242")
    assert spec.rdzv_endpoint == "gpu07:29700"  # host from SLURM, port from the recipe


def test_slurm_master_addr_wins_over_nodelist():
    out = apply_slurm_env({"entry": "m"}, {**SLURM, "MASTER_ADDR": "10.0.0.5"})
    assert out["rdzv_endpoint"] == "10.0.0.5:29500"


def test_recipe_fields_win_over_slurm():
    launch = {"entry": "m", "nnodes": 2, "rdzv_id": "mine", "rdzv_endpoint": "head:1"}
    out = apply_slurm_env(launch, SLURM)
    assert (out["nnodes"], out["rdzv_id"], out["rdzv_endpoint"]) == (2, "mine", "head:1")
    assert out["node_rank"] == "3"


def test_no_slurm_no_change(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert apply_slurm_env({"entry": "m"}, {"SLURM_NNODES": "4"}) == {"entry": "m"}
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("MASTER_ADDR", "head")
    spec = load_recipe(write_recipe(tmp_path)).launch  # reads os.environ by default
    assert (spec.nnodes, spec.node_rank, spec.rdzv_endpoint) == (2, 1, "head:29500")


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("a01,a02", "a01"),
        ("node[3-5]", "node3"),
        ("node[03-05,09]", "node03"),
        ("head,gpu[1-2]", "head"),
        ("single", "single"),
        ("", None),
        ("[weird", None),
    ],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


# ----------------------------------------------------------------------------- help, fast start


def test_every_registered_command_is_a_command_of_the_app_with_its_own_module():
    top_level = [words[0] for words, _ in registered_commands() if len(words) == 1]
    assert top_level == list(COMMANDS)
    modules = {path.stem for path in Path(commands.__file__).parent.glob("*.py")}
    assert modules - {"__init__"} == {name.replace("-", "_") for name in COMMANDS}


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help(flag):
    result = invoke(flag)
    assert result.exit_code == 0, result.output
    commands = registered_commands()[1:]
    for words, command in commands:
        if len(words) == 1:
            assert words[0] in result.output
        sub = invoke(*words, flag)
        assert sub.exit_code == 0, sub.output
        if any(param.name == "recipe" for param in command.params):
            assert "RECIPE" in sub.output and "KEY=VALUE" in sub.output
    assert ["cache", "build"] in [words for words, _ in commands]  # groups are walked too


def test_help_and_inspect_config_do_not_import_torch(tmp_path):
    recipe = write_recipe(tmp_path)
    snippet = textwrap.dedent(
        f"""
        import sys
        from typer.testing import CliRunner
        from litegen_cli.app import app

        runner = CliRunner()
        assert runner.invoke(app, ["--help"]).exit_code == 0
        result = runner.invoke(app, ["inspect-config", {str(recipe)!r}])
        assert result.exit_code == 0, result.output
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not loaded, loaded[:5]
        """
    )
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_inspect_config_checks_a_finetune_recipe_without_importing_torch(tmp_path):
    """The finetune section, the pipeline folder's family and the media scan (bucket
    feasibility included) are checked in the CLI process, torch-free."""
    pytest.importorskip("av")
    from tests.media import make_media_folder
    from tests.pipelines import tiny_pipeline_folder

    media = make_media_folder(tmp_path / "media", images=2, videos=2)
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "finetune_video.yaml"
    common = [str(recipe), "launch.nproc_per_node=1", "finetune.data.max_frames=9",
              f"finetune.pipeline={tiny_pipeline_folder('wan')}", f"finetune.data.folder={media}"]  # fmt: skip
    snippet = textwrap.dedent(
        f"""
        import sys
        from typer.testing import CliRunner
        from litegen_cli.app import app

        runner = CliRunner()
        result = runner.invoke(app, ["inspect-config", *{common!r}, "global_batch_size=2"])
        assert result.exit_code == 0, result.output
        result = runner.invoke(app, ["inspect-config", *{common!r}, "global_batch_size=4"],
                               env={{"COLUMNS": "300"}})
        assert result.exit_code == 2 and "no bucket" in result.output, result.output
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not loaded, loaded[:5]
        """
    )
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_plan_numbers(tmp_path):
    plan = derive_run_shape(load_recipe(write_recipe(tmp_path), ["launch.nnodes=2"], env={}))
    assert (plan.world_size, plan.dp_size, plan.micro_batch) == (4, 4, 1)
    assert plan.sp_size == 1 and plan.tokens_per_rank is None
    assert plan.strategy == "ddp" and plan.device == "cpu"


def test_plan_says_when_auto_checkpointing_is_chosen(tmp_path):
    prefix = "optimization.memory.activation_checkpoint"
    overrides = [f"{prefix}.enabled=true", f"{prefix}.selective_ratio=auto"]
    plan = derive_run_shape(load_recipe(write_recipe(tmp_path, runtime={}), overrides, env={}))
    assert plan.memory == "checkpointing auto within 90% of device memory: chosen on the first step"
    budget = [*overrides, f"{prefix}.memory_budget_gib=2"]
    plan = derive_run_shape(load_recipe(write_recipe(tmp_path), budget, env={}))
    assert plan.memory == "checkpointing auto within 2.0 GiB: chosen on the first step"
    plan = derive_run_shape(load_recipe(write_recipe(tmp_path), [], env={}))
    assert plan.memory == "off"


@pytest.mark.parametrize(
    ("fields", "shown"),
    [
        ([], "checkpointing no block (selective_ratio 1.0; lower it to checkpoint), policy block"),
        (["selective_ratio=0.0"], "checkpointing every block (selective_ratio 0.0)"),
        (
            ["selective_ratio=0.25"],
            "75% of the model's blocks (selective_ratio 0.25: 9 of 12, 21 of 28)",
        ),
        (
            ["selective_ratio=0.5", "target_paths=[a,b,c]"],
            "checkpointing 1 of the 3 target_paths blocks",
        ),
    ],
)
def test_the_plan_shows_how_many_blocks_are_checkpointed(tmp_path, fields, shown):
    prefix = "optimization.memory.activation_checkpoint"
    overrides = [f"{prefix}.enabled=true", *(f"{prefix}.{f}" for f in fields)]
    result = invoke("inspect-config", write_recipe(tmp_path), *overrides)
    assert result.exit_code == 0, result.output
    assert shown in " ".join(result.output.replace("│", " ").split())


def test_plan_shows_where_weights_live_and_in_which_precision(tmp_path):
    plan = derive_run_shape(load_recipe(write_recipe(tmp_path), [], env={}))
    assert plan.weights == "on the device, in their dtype"
    overrides = [
        "optimization.parallel.strategy=fsdp2",
        "optimization.parallel.fsdp2.cpu_offload=true",
        "optimization.precision.fp8_linear=rowwise",
    ]
    plan = derive_run_shape(load_recipe(write_recipe(tmp_path), overrides, env={}))
    assert plan.weights == (
        "parameters, gradients and optimizer state in host memory (cpu_offload); "
        "fp8 Linear matmuls (rowwise, where the GPU and torchao allow)"
    )
    lora = [
        "optimization.lora.target_modules=[to_q]",
        "optimization.lora.fp8_base=tensorwise",
        "optimization.memory.block_swap.blocks_on_device=4",
    ]
    plan = derive_run_shape(load_recipe(write_recipe(tmp_path), lora, env={}))
    assert plan.weights == "frozen Linear weights in fp8 (tensorwise)"
    assert plan.memory == "block swap: frozen weights of all but 4 blocks in host memory"
    result = invoke("inspect-config", write_recipe(tmp_path), *lora)
    assert result.exit_code == 0, result.output
    assert "frozen Linear weights in fp8" in " ".join(result.output.split())


def test_torchruns_banner_and_agent_logs_are_silenced(caplog):
    """torchrun's launcher warns about OMP_NUM_THREADS in a banner on every launch of 2+ ranks
    (then sets it to 1 itself); the CLI keeps the launcher's and the agent's loggers quiet."""
    import logging

    import torch.distributed.run

    launcher._quiet_torchrun()
    for name in ("torch.distributed.run", "torch.distributed.elastic.agent.server.api"):
        logger = logging.getLogger(name)
        with caplog.at_level(logging.WARNING):
            logger.warning("banner")
        assert logger.level == logging.CRITICAL, name
    assert torch.distributed.run.__name__ not in [r.name for r in caplog.records]
