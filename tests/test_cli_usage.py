"""The CLI refuses nonsense up front (exit 2, argparse's way; the folder options before any import of
torch), one rule per option in every command, reports environment problems in one line (never a
traceback), and shows/clears its cache. Ctrl-C: tests/test_ctrl_c.py."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pakv_onnx
from pakv_onnx import cli, kernels, paths
from pakv_onnx.cases import seeded_randn


def _err(capsys: pytest.CaptureFixture) -> str:
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
        (["demo", "--tokens", "-3"], "argument --tokens: must be >= 1, got -3"),
        (["demo", "--repeats", "two"], "argument --repeats: want an integer, got 'two'"),
        (["demo", "--backend", ","], "want comma-separated backend names"),
        (["cases", "--random", "-1"], "argument --random: must be >= 0, got -1"),
        (["cases", "level0", "nope"], "argument ID: unknown case id 'nope'"),
        (["cases", "--backend", "fastest"], "backend 'fastest' is unknown"),
    ],
)
def test_nonsense_is_a_usage_error(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(argv) == 2
    err = _err(capsys)
    assert message in err and err.startswith("usage: pakv-onnx")


@pytest.mark.parametrize("command", ["demo", "cases"])
def test_a_backend_that_cannot_run_here_is_refused_with_its_reason(
    command: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pypto cannot run on these machines (no NPU); the refusal must say why, and what can run.
    reason = kernels.get_backend("pypto").unavailable_reason()
    assert reason is not None
    start = time.perf_counter()
    assert cli.main([command, "--backend", "pypto"]) == 2
    assert time.perf_counter() - start < 5  # refused before any model or case is built
    err = _err(capsys)
    assert f"backend 'pypto' cannot run here: {reason}" in err and "backends that can: native" in err


# --help of every command, and usage errors argparse or a command finds before any work.
TORCH_FREE_ARGVS = [
    ["--help"],
    *([m.rsplit(".", 1)[1].replace("_", "-"), "--help"] for m in cli.COMMAND_MODULES),
    ["--bogus"],
    [],
    ["demo", "--repeats", "0"],
    ["demo", "--model", "vit"],
    ["cases", "level0", "nope"],
    ["cases", "--backend", "fastest"],
    ["generate", "--arch", "llama", "--batch", "99"],
    ["export", "no-such-folder", "out"],
    ["tune", "--dtype", "float64"],
    ["verify-kernel", "--device", "gpu"],
]


def test_help_and_usage_errors_do_not_import_torch() -> None:
    """``--help`` and a usage error answer at once: the parsers need neither torch nor any model."""
    script = f"""
import contextlib, io, sys
from pakv_onnx import cli
heavy = ("torch", "transformers", "onnx", "onnxruntime", "numpy")
for argv in {TORCH_FREE_ARGVS!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = cli.main(argv)
    assert code in (0, 2), (argv, code, err.getvalue())
    assert code == 0 or "error:" in err.getvalue(), (argv, err.getvalue())
    loaded = [name for name in heavy if name in sys.modules]
    assert not loaded, (argv, "imported", loaded)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_an_unknown_option_before_the_command_is_named(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["--bogus"]) == 2
    assert "pakv-onnx: error: unrecognized arguments: --bogus" in _err(capsys)


def test_version(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pakv-onnx {pakv_onnx.__version__}"


def test_cases_says_what_auto_resolved_to(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["cases", "heads1_k128_v64"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("backend: auto -> native")
    assert "-> on native: key=" in out and "(backend auto -> native)" in out


# --------------------------------------------------------------------------- #
# Environment problems: one line naming the path and what to set
# --------------------------------------------------------------------------- #
def test_empty_home_never_puts_the_cache_at_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(paths.CACHE_DIR_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    for home in ("", "relative/home"):
        monkeypatch.setenv("HOME", home)
        with pytest.raises(paths.CacheDirError, match="HOME is .*set PAKV_ONNX_CACHE_DIR"):
            paths.cache_dir("x")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # ignored, as the XDG spec says
    with pytest.raises(paths.CacheDirError):
        paths.cache_root()


def test_uncreatable_cache_dir_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(paths.CACHE_DIR_ENV, str(blocker / "cache"))
    with pytest.raises(paths.CacheDirError) as caught:
        paths.cache_dir("pypto")
    message = str(caught.value)
    assert str(blocker / "cache") in message and "set PAKV_ONNX_CACHE_DIR" in message and "\n" not in message


def _run_cli(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pakv_onnx.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


# --------------------------------------------------------------------------- #
# export: HF_DIR and OUT_DIR checked before torch or any weight is loaded
# --------------------------------------------------------------------------- #
def _model_folder(path: Path, *, weights: bool = True) -> Path:
    """A folder with a Llama config.json and (``weights``) an empty weights file: enough for the checks."""
    from pakv_onnx.models.hf import make_config

    make_config("llama").save_pretrained(path)
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return path


def test_export_refuses_a_folder_without_weights_in_one_line(tmp_path: Path) -> None:
    hf = _model_folder(tmp_path / "hf", weights=False)
    result = _run_cli("export", str(hf), str(tmp_path / "out"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"pakv-onnx export: error: argument HF_DIR: {hf}: no weights (none of model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin, pytorch_model.bin.index.json; nothing is downloaded)"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("full", "argument OUT_DIR: full: exists and is not empty; pass --force to write into it"),
        ("a-file", "argument OUT_DIR: a-file: exists and is not a folder"),
        ("a-file/out", "argument OUT_DIR: a-file/out: {tmp}/a-file is not a folder"),
        ("hf", "argument OUT_DIR: hf: it is HF_DIR; give the output a folder of its own"),
    ],
)
def test_export_refuses_an_out_dir_it_must_not_write(
    out: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pakv_onnx.models.hf import genai

    monkeypatch.setattr(genai, "load_hf_config", lambda hf_dir: pytest.fail("read the model before refusing OUT_DIR"))
    _model_folder(tmp_path / "hf")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    (tmp_path / "a-file").write_text("")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["export", "hf", out]) == 2
    err = _err(capsys).strip()
    assert err.startswith(f"pakv-onnx export: error: {message.format(tmp=tmp_path)}") and "\n" not in err
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_export_writes_into_an_empty_or_forced_out_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export writes a staging folder (inside an existing OUT_DIR, else beside it); a failed export
    leaves OUT_DIR as it was: no new folder, no file."""
    from pakv_onnx.commands._outputs import STAGING_PREFIX
    from pakv_onnx.models.hf import genai

    reached = []

    def fake_export(hf_dir, out_dir, **options):
        reached.append(Path(out_dir).relative_to(tmp_path))
        (Path(out_dir) / "model.onnx").write_text("half-written")
        raise genai.UnsupportedModelError("stop here")

    monkeypatch.setattr(genai, "export_genai", fake_export)
    hf = _model_folder(tmp_path / "hf")
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model.onnx").write_text("an earlier export")
    for argv in (["empty"], ["new/nested"], ["full", "--force"]):
        assert cli.main(["export", str(hf), str(tmp_path / argv[0]), *argv[1:]]) == 2
        assert _err(capsys).strip() == "pakv-onnx export: error: stop here"
    expected = [("empty", ".empty"), (".", ".nested"), ("full", ".full")]  # (where, name) of each staging folder
    assert [(str(p.parent), p.name.split(STAGING_PREFIX)[0]) for p in reached] == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full", "hf"]
    assert list((tmp_path / "empty").iterdir()) == []
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["model.onnx"]
    assert (tmp_path / "full" / "model.onnx").read_text() == "an earlier export"


def test_export_refuses_a_model_without_a_kv_geometry_before_its_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import GPT2Config

    from pakv_onnx.models.hf import genai

    monkeypatch.setattr(genai, "load_hf_model", lambda hf_dir: pytest.fail("loaded the weights before refusing"))
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64).save_pretrained(tmp_path / "gpt2")
    (tmp_path / "gpt2" / "model.safetensors").write_bytes(b"")
    assert cli.main(["export", str(tmp_path / "gpt2"), str(tmp_path / "out")]) == 2
    err = _err(capsys)
    assert "pakv-onnx export: error: gpt2 (GPT2Config): its config has no num_key_value_heads;" in err
    assert "AttributeError" not in err and "object has no attribute" not in err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- #
# One rule per option, checked before any work or import of torch
# --------------------------------------------------------------------------- #
def _refusal_cases(root: Path) -> list[tuple[list[str], str]]:
    """(argv, the refusal it gets) for each folder option and range, every command that takes it."""
    hf = _model_folder(root / "hf")
    (root / "full").mkdir()
    (root / "full" / "notes.txt").write_text("mine")
    (root / "a-file").write_text("")
    outputs = {"demo": ["demo", "--out"], "generate": ["generate", "--out"], "export": ["export", str(hf)]}
    cases = []
    for command, prefix in outputs.items():
        label = "OUT_DIR" if command == "export" else "--out"
        cases += [
            ([*prefix, str(root / "full")], f"argument {label}: {root / 'full'}: exists and is not empty; pass --force"),
            ([*prefix, str(root / "a-file")], f"argument {label}: {root / 'a-file'}: exists and is not a folder"),
            ([*prefix, str(root / "a-file" / "x")], f"argument {label}: {root / 'a-file' / 'x'}: {root / 'a-file'} is not a folder"),
            ([*prefix, "/proc/nope"], f"argument {label}: /proc/nope: cannot write to /proc:"),
        ]  # fmt: skip
    for argv in (["export", str(hf), "out"], ["generate"], ["genai-cpu", "x"], ["tune"]):
        cases.append(([*argv, "--block-size", "100000"], "argument --block-size: must be in 1..1024, got 100000"))
        cases.append(([*argv, "--block-size", "0"], "argument --block-size: must be in 1..1024, got 0"))
    for argv in (["demo"], ["cases"], ["generate"], ["verify-kernel"]):
        cases.append(([*argv, "--seed", "-1"], "argument --seed: must be in 0..4294967295, got -1"))
    cases += [
        (["genai-cpu", str(root / "no-such-dir")], f"argument MODEL_DIR: {root / 'no-such-dir'}: no such folder"),
        (["genai-cpu", str(root / "a-file")], f"argument MODEL_DIR: {root / 'a-file'}: not a folder"),
        (["genai-cpu", str(root / "full")], f"argument MODEL_DIR: {root / 'full'}: is not an ORT GenAI paged model: no genai_config.json"),
        (["export", str(root / "no-such-dir"), "out"], f"argument HF_DIR: {root / 'no-such-dir'}: no such folder"),
        (["export", str(root / "full"), "out"], f"argument HF_DIR: {root / 'full'}: no config.json"),
        (["export", str(hf), "out", "--num-blocks", "0"], "argument --num-blocks: must be >= 1, got 0"),
        (["export", str(hf), "out", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (["genai-cpu", "x", "--max-batch-size", "0"], "argument --max-batch-size: must be >= 1, got 0"),
    ]  # fmt: skip
    return cases


def test_every_refusal_names_its_option_before_torch_is_imported(tmp_path: Path) -> None:
    """Each output folder, input folder and option range is refused by the same rule in every command
    that takes it, in one line naming the option, with torch and transformers never imported."""
    cases = _refusal_cases(tmp_path)
    script = f"""
import contextlib, io, json, sys, time
from pakv_onnx import cli
heavy = ("torch", "transformers", "onnx", "onnxruntime", "numpy")
results = []
for argv in {[argv for argv, _ in cases]!r}:
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = cli.main(argv)
    results.append((code, err.getvalue(), [m for m in heavy if m in sys.modules], time.perf_counter() - start))
print(json.dumps(results))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    for (argv, message), (code, err, loaded, _seconds) in zip(cases, json.loads(done.stdout)):
        command = argv[0]
        assert code == 2 and f"pakv-onnx {command}: error: {message}" in err, (argv, err)
        assert not loaded, (argv, "imported", loaded)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "full", "hf"]  # nothing made by a refusal


def test_demo_out_follows_export_rule_and_generate_defaults_to_llama() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["generate"]).arch == "llama"
    demo = parser.parse_args(["demo", "--out", "x", "--force"])
    assert demo.out == Path("x") and demo.force  # parsing makes no folder; --force as in export


def test_one_definition_of_each_shared_option() -> None:
    """Every command taking a shared option declares it the same way (the _args helper's type and metavar)."""
    from pakv_onnx.commands import _args

    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    shared = {"--block-size": _args.MAX_BLOCK_SIZE, "--seed": _args.MAX_SEED}
    for flag, high in shared.items():
        takers = [name for name, sub in commands.items() if flag in sub._option_string_actions]
        assert len(takers) >= 2, (flag, takers)
        for name in takers:
            action = commands[name]._option_string_actions[flag]
            assert action.metavar == "N", (name, flag)
            with pytest.raises(argparse.ArgumentTypeError, match=f"must be in .*\\.\\.{high}"):
                action.type(str(high + 1))
    for flag in ("--num-blocks", "--max-batch-size", "--threads"):
        takers = [name for name, sub in commands.items() if flag in sub._option_string_actions]
        assert len(takers) >= 2 and "serve" in takers, (flag, takers)
        for name in takers:
            action = commands[name]._option_string_actions[flag]
            assert (action.type, action.metavar) == (_args.positive_int, "N"), (name, flag)
    readers = {name: sub.get_default(_args.PATH_RULES) or () for name, sub in commands.items()}
    assert any(not rule.output for rule in readers["serve"]), "serve's FOLDER is add_input_folder's"


def test_cache_command_with_empty_home_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    env = {"HOME": "", "XDG_CACHE_HOME": ""}
    result = subprocess.run(
        [sys.executable, "-m", "pakv_onnx.cli", "cache"],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in {**os.environ, **env}.items() if k != paths.CACHE_DIR_ENV},
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "pakv-onnx cache: error: cannot place the pakv-onnx cache: HOME is empty; set PAKV_ONNX_CACHE_DIR to a "
        "writable directory"
    ]


def test_unwritable_out_dir_is_refused_up_front(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(["demo", "--out", str(blocker / "models")]) == 2
    assert f"argument --out: {blocker / 'models'}: {blocker} is not a folder" in _err(capsys)


def _read_only_mount(path: Path) -> list[str]:
    """argv prefix running a command with ``path`` bind-mounted read-only (a private mount namespace)."""
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount --bind {path} {path} && mount -o remount,bind,ro {path}"],
        capture_output=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a read-only mount here: {probe.stderr.decode().strip()}")
    return ["unshare", "-m", "sh", "-c", f'mount --bind {path} {path} && mount -o remount,bind,ro {path} && exec "$@"', "sh"]


def test_read_only_cwd_home_and_cache(tmp_path: Path) -> None:
    """On a read-only filesystem: a relative --out and the cache are one-line errors; nothing else writes the cwd."""
    (tmp_path / "home").mkdir()
    (tmp_path / "cache").mkdir()
    prefix = _read_only_mount(tmp_path)
    env = {**os.environ, "HOME": str(tmp_path / "home"), paths.CACHE_DIR_ENV: str(tmp_path / "cache" / "pakv")}
    base = [sys.executable, "-m", "pakv_onnx.cli"]

    out = subprocess.run([*prefix, *base, "demo", "--out", "models"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and f"argument --out: models: cannot write to {tmp_path}: Read-only file system" in out.stderr

    cache = subprocess.run([*prefix, *base, "cache"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert cache.returncode == 0 and "does not exist yet" in cache.stdout  # showing never creates it

    probe = "from pakv_onnx import paths; paths.cache_dir('pypto')"
    made = subprocess.run([*prefix, sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "CacheDirError: cannot create the pakv-onnx cache directory" in made.stderr
    assert "Read-only file system; set PAKV_ONNX_CACHE_DIR to a writable directory" in made.stderr

    listed = subprocess.run([*prefix, *base, "cases", "heads1_k128_v64"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr  # the checking commands need no writable cwd or home
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "home"]


# --------------------------------------------------------------------------- #
# The cache command
# --------------------------------------------------------------------------- #
def test_cache_shows_sizes_and_clears(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "cache"
    monkeypatch.setenv(paths.CACHE_DIR_ENV, str(root))
    assert cli.main(["cache"]) == 0
    assert "does not exist yet" in capsys.readouterr().out
    (paths.cache_dir("pypto", "runs", "r1") / "log.txt").write_bytes(b"x" * 2500)
    (paths.cache_dir("other") / "f").write_bytes(b"y" * 10)
    assert cli.main(["cache"]) == 0
    out = capsys.readouterr().out
    assert f"cache directory: {root}" in out and "pypto/" in out and "2.5 kB" in out and "10 B" in out
    assert cli.main(["cache", "--clear"]) == 0
    assert "freed 2.5 kB" in capsys.readouterr().out
    assert [p.name for p in root.iterdir()] == [paths.CACHEDIR_TAG]


def test_cache_clear_never_empties_a_directory_it_did_not_make(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    mine = tmp_path / "my-files"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    monkeypatch.setenv(paths.CACHE_DIR_ENV, str(mine))
    paths.cache_dir("pypto")  # a non-empty directory is used but never tagged
    assert cli.main(["cache", "--clear"]) == 2
    assert "not clearing" in _err(capsys)
    assert (mine / "thesis.tex").read_text() == "precious"


def test_seed_caches_are_generated_in_chunks_bit_for_bit() -> None:
    """Chunked generation (interruptible) equals one randn + cast, values and generator state alike."""
    for total, chunk in ((10, 16), (15, 16), (16, 16), (47, 16), (1000, 32), (4097, 64), (65536 + 7, 4096), (33, 16)):
        one = torch.Generator().manual_seed(total)
        chunked = torch.Generator().manual_seed(total)
        expected = torch.randn((total,), generator=one).to(torch.bfloat16)
        got = seeded_randn((total,), chunked, torch.bfloat16, chunk=chunk)
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), (total, chunk)
        assert torch.equal(torch.randn(64, generator=one), torch.randn(64, generator=chunked)), (total, chunk)
    shape = (64, 128, 1, 128)  # heads1_k128_v64's key cache, with the default chunk
    expected = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = seeded_randn(shape, torch.Generator().manual_seed(3), torch.bfloat16, chunk=1 << 16)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_every_help_example_parses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The examples each ``--help`` shows are real: every one parses with its command's parser."""
    import shlex

    monkeypatch.chdir(tmp_path)  # parsing `--out ./onnx` makes the folder: not in the caller's cwd

    from pakv_onnx.commands import _args

    parser = cli.build_parser()
    assert set(_args.EXAMPLES) == {m.rsplit(".", 1)[1].replace("_", "-") for m in cli.COMMAND_MODULES}
    for name, examples in _args.EXAMPLES.items():
        assert examples, f"{name} --help shows no example"
        for example in examples:
            argv = [name, *shlex.split(example.partition("  # ")[0].replace("\n", " "))]
            try:
                assert parser.parse_args(argv).command == name
            except SystemExit:
                pytest.fail(f"the --help example `pakv-onnx {' '.join(argv)}` does not parse")


@pytest.mark.parametrize("where", ["import", "progress bars"])
@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_missing_transformers_is_a_usage_error_naming_the_extra(
    command: str, where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The transformers commands import it when they run (commands._libraries.load_hf): a transformers
    that fails there, at the import of the command's module or when its progress bars are turned off,
    is one line naming the extra to install (exit 2), not a traceback."""
    from pakv_onnx.commands import _libraries

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    argv = {"generate": ["generate", "--batch", "1"], "export": ["export", str(hf), str(tmp_path / "out")]}[command]
    if where == "import":
        module = {"generate": "check", "export": "genai"}[command]
        monkeypatch.setitem(sys.modules, f"pakv_onnx.models.hf.{module}", None)  # its import fails
    else:

        def broken() -> None:
            raise ModuleNotFoundError("No module named 'transformers.utils'")

        monkeypatch.setattr(_libraries, "quiet_transformers", broken)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"pakv-onnx {command}: error: it needs transformers (pip install 'pakv-onnx[hf]'): " in err, err
