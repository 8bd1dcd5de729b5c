"""`phalanx serve`'s user errors end the command before anything loads, with one line
naming the flag and exit status 2 (no traceback); vLLM's spellings (`serve MODEL`,
`-tp`, `--tensor-parallel-size`, `-dp`, `--data-parallel-size`, `--dtype`,
`--enforce-eager`, `--gpu-memory-utilization`, `--load-format`) and `phalanx --version`."""

from __future__ import annotations

import socket

import pytest

from phalanx import __version__
from phalanx.cli import build_parser, main
from phalanx.server.serve_checks import check_serve_args


@pytest.mark.parametrize("argv, says", [
    (["--tp", "0", "--dp", "1"], "--tp must be at least 1"),
    (["--decode-dp", "-2"], "--decode-dp must be at least 1"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--api-key", ""], "--api-key must not be empty"),
    (["--dp", "2", "--routing-policy", "bogus"], "--routing-policy 'bogus' is not a known"),
    (["--ep-policy", "sometimes"], "--ep-policy 'sometimes'"),
    (["--microbatch", "maybe"], "--microbatch 'maybe'"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
    (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid' does not resolve"),
    (["--tp", "2", "--decode-dp", "2"], "either --tp/--dp (colocated) or"),
    (["--collective-timeout", "0"], "--collective-timeout must be a positive"),
    (["--allowed-origins", "app.example"], "'app.example' is not an origin"),
    (["/tmp", "--model", "/other"], "two models given"),
    (["/proc"], "--model /proc: not a model folder (no config.json there"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--cuda-graph-max-prefill", "8"], "--cuda-graph-max-prefill must be 0 (eager) or at least 16"),
])
def test_a_user_error_is_one_line_before_loading(capsys, argv, says):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err, err
    assert "Traceback" not in err and "loading" not in err, err


def test_a_taken_port_and_a_context_beyond_the_model(capsys, tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in capsys.readouterr().err
    assert main(["serve", str(tiny_model), "--max-model-len", "100000000"]) == 2
    assert "exceeds the model's context" in capsys.readouterr().err


def test_vllm_spellings_and_version(capsys, tiny_model):
    args = build_parser().parse_args(["serve", str(tiny_model), "-tp", "2",
                                      "--data-parallel-size", "1", "--port", "0"])
    assert (args.model_path, args.tp, args.dp) == (str(tiny_model), 2, 1)
    check_serve_args(args)  # a good command passes
    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "1", "-dp", "2"])
    assert (args.tp, args.dp) == (1, 2)
    args = build_parser().parse_args(["serve", "--dtype", "float16", "--enforce-eager",
                                      "--gpu-memory-utilization", "0.5",
                                      "--load-format", "dummy"])
    assert (args.dtype, args.enforce_eager, args.gpu_memory_utilization, args.load_format) == \
        ("float16", True, 0.5, "dummy")
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"phalanx {__version__}"


def test_ctrl_c_in_generate_is_one_line_and_status_130(tiny_model):
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "phalanx.cli", "generate", "hello",
                             "--model", str(tiny_model), "--max-tokens", "100000",
                             "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.read(1)  # generating
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err.decode()[-2000:]
    assert b"Traceback" not in err and err.strip().endswith(b"phalanx: interrupted"), err[-2000:]


def test_an_error_inside_a_rank_is_one_line_without_the_remote_traceback():
    from ray.exceptions import RayTaskError

    from phalanx.cli import _user_message

    cause = ValueError("model.layers.1.mlp.experts w13: checkpoint shape (8, 128, 128) != "
                       "expected (8, 144, 128)")
    remote = RayTaskError("DecodeRank.start", "Traceback (most recent call last):\n  File ...",
                          cause).as_instanceof_cause()
    assert isinstance(remote, ValueError) and "File ..." in str(remote)
    assert _user_message(remote) == str(cause)
    assert _user_message(OSError("port 8000 is taken")) == "port 8000 is taken"
