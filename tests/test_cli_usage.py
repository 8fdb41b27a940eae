"""The CLI refuses nonsense up front (exit 2, argparse's way), reports environment problems in one
line (never a traceback), exits 130 on Ctrl-C, and shows/clears its cache."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pakv_onnx
from pakv_onnx import cli, kernels, paths
from pakv_onnx.commands import _interrupt
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
    ["generate"],
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
        f"pakv-onnx export: error: {hf}: no weights (none of model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin, pytorch_model.bin.index.json; nothing is downloaded)"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("full", "full: exists and is not empty; pass --force to write into it"),
        ("a-file", "a-file: exists and is not a folder"),
        ("a-file/out", "a-file/out: {tmp}/a-file is not a folder"),
        ("hf", "hf: OUT_DIR is HF_DIR"),
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
    from pakv_onnx.models.hf import genai

    reached = []

    def fake_export(hf_dir, out_dir, **options):
        reached.append(Path(out_dir).name)
        raise genai.UnsupportedModelError("stop here")

    monkeypatch.setattr(genai, "export_genai", fake_export)
    hf = _model_folder(tmp_path / "hf")
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model.onnx").write_text("an earlier export")
    for argv in (["empty"], ["new/nested"], ["full", "--force"]):
        assert cli.main(["export", str(hf), str(tmp_path / argv[0]), *argv[1:]]) == 2
        assert _err(capsys).strip() == "pakv-onnx export: error: stop here"
    assert reached == ["empty", "nested", "full"]


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
    assert f"argument --out: cannot write to {blocker / 'models'}: Not a directory" in _err(capsys)


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
    assert out.returncode == 2 and f"argument --out: cannot write to {tmp_path / 'models'}: Read-only file system" in out.stderr

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


# --------------------------------------------------------------------------- #
# Ctrl-C
# --------------------------------------------------------------------------- #
def _interrupt_after(argv: list[str], marker: str, stream: str, env: dict[str, str] | None = None, cwd=None):
    process = subprocess.Popen(
        [sys.executable, "-m", "pakv_onnx.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    pipe = process.stdout if stream == "out" else process.stderr
    seen = ""
    while marker not in seen:
        line = pipe.readline()
        assert line, f"{argv} ended before printing {marker!r}"
        seen += line
    process.send_signal(signal.SIGINT)
    start = time.perf_counter()
    out, err = process.communicate(timeout=60)
    return process.returncode, (seen + out if stream == "out" else out), (seen + err if stream == "err" else err), time.perf_counter() - start


def test_ctrl_c_in_cases_exits_130_with_one_line() -> None:
    # One small seed case, then endless small random ones (never the 812 MB sweep cases here).
    code, _out, err, seconds = _interrupt_after(["cases", "heads1_k128_v64", "--random", "1000000"], "[2/", "out")
    assert code == 130
    assert err.strip().splitlines()[-1] == "pakv-onnx: interrupted" and "Traceback" not in err
    assert seconds < 10


def test_ctrl_c_in_demo_leaves_no_partial_output(tmp_path: Path) -> None:
    out_dir = tmp_path / "models"
    code, _out, err, _seconds = _interrupt_after(
        ["demo", "--model", "gqa", "--tokens", "64", "--repeats", "1", "--out", str(out_dir)], "exporting gqa", "err"
    )
    assert code == 130 and "Traceback" not in err and err.strip().splitlines()[-1] == "pakv-onnx: interrupted"
    assert list(out_dir.iterdir()) == []  # the staging directory is gone, no half-written model


# A command whose body does what libraries do to a KeyboardInterrupt (commands/_interrupt.py), run
# through cli.main in a child: `swallow` drops every one (a weakref callback, forever), `once` drops
# the first and works on, `convert` turns it into another exception, `stuck` sits in a call that
# ignores it. Each prints "started" (and creates the folder argv[2] names, registered for a hard exit).
_MISBEHAVING = r"""
import os, shutil, sys, time, types
from pakv_onnx import cli
from pakv_onnx.commands import _args, _interrupt

def run(args):
    os.makedirs(args.folder)
    _interrupt.on_hard_exit(lambda: shutil.rmtree(args.folder, ignore_errors=True))
    announced, dropped = [], 0

    def work():  # "started" from inside the try blocks below: every Ctrl-C after it meets the handlers
        if not announced:
            announced.append(print("started", flush=True))
        time.sleep(0.01)

    while True:
        try:
            while args.how == "stuck":
                try:
                    work()
                except KeyboardInterrupt:
                    pass
            work()
        except KeyboardInterrupt:
            dropped += 1
            if args.how == "convert":
                raise AttributeError("module 'torch._dynamo' has no attribute 'exc'")
            if args.how == "once" and dropped > 1:
                raise
            print(f"dropped {dropped}", file=sys.stderr, flush=True)

def add_parser(commands):
    parser = _args.add_command(commands, "misbehave", help="test", description="test", examples=[""])
    parser.add_argument("how")
    parser.add_argument("folder")
    parser.set_defaults(run=run)

sys.modules["misbehaving"] = types.SimpleNamespace(add_parser=add_parser)
cli.COMMAND_MODULES += ("misbehaving",)
sys.exit(cli.main(["misbehave", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("how", ["once", "convert", "swallow", "stuck"])
def test_ctrl_c_ends_a_command_whatever_a_library_does_with_it(how: str, tmp_path: Path) -> None:
    folder = tmp_path / "work"
    process = subprocess.Popen(
        [sys.executable, "-c", _MISBEHAVING, how, str(folder)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout.readline() == "started\n"
    process.send_signal(signal.SIGINT)
    start = time.perf_counter()
    _out, err = process.communicate(timeout=60)
    seconds = time.perf_counter() - start
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1] == "pakv-onnx: interrupted" and "Traceback" not in err, err
    if how in ("swallow", "stuck"):  # never caught: the hard exit, with its cleanups
        assert _interrupt.HARD_EXIT_SECONDS <= seconds < 30 and not folder.exists(), (seconds, err)
    else:  # re-raised (once) or any exception after Ctrl-C (convert): ends through cli.main
        assert seconds < 30 and folder.exists()
    assert ("dropped 1" in err) == (how in ("once", "swallow"))


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
