"""`phalanx serve`'s flags checked before anything loads: a user error ends the command
at once with one line naming the flag (cli.py prints it, exit status 2), never a
traceback and never after minutes of loading.

Checked: the host resolves and the port is free and in range; an API key is not empty;
counts are positive; `--gpu-memory-utilization` is in (0, 1] and
`--cuda-graph-max-prefill` 0 or >= 16; the layout flags do not conflict; the routing, EP-width and
micro-batch policies are registered names; the device is `cpu` or an existing CUDA
device; `--max-model-len` fits the model folder's context; the folder holds a
`config.json`; `--allowed-origins` are origins.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import socket

__all__ = ["check_serve_args"]

_POSITIVE = ("tp", "dp", "prefill_tp", "prefill_instances", "decode_dp", "decode_tp",
             "prefill_page_size", "max_num_seqs", "max_num_batched_tokens", "page_size",
             "max_body_bytes", "ep_groups")
_NON_NEGATIVE = ("num_pages", "max_model_len", "max_recoveries", "microbatch_min_tokens",
                 "stream_resume")
_SECONDS = ("collective_timeout", "recovery_window", "replace_timeout")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_serve_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag of the first user error in `args` (cli.py's serve)."""
    _check_numbers(args)
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty (leave it out to serve without a key)")
    from .launch import LAYOUT_KEYS, resolve_layout
    resolve_layout(**{k: getattr(args, k, None) for k in LAYOUT_KEYS})
    _check_policies(args)
    _check_device(args.device)
    _check_model(args.model, args.max_model_len)
    _check_bind(args.host, args.port)


def _check_numbers(args: argparse.Namespace) -> None:
    for name in _POSITIVE:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"{_flag(name)} must be at least 1, got {value}")
    for name in _NON_NEGATIVE:
        value = getattr(args, name, None)
        if value is not None and value < 0:
            raise ValueError(f"{_flag(name)} must be 0 or more, got {value}")
    for name in _SECONDS:
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            raise ValueError(f"{_flag(name)} must be a positive number of seconds, got {value}")
    hold = getattr(args, "router_hold", None)
    if hold is not None and hold < 0:
        raise ValueError(f"--router-hold must be 0 (no hold) or a positive number of requests, "
                         f"got {hold}")
    share = getattr(args, "gpu_memory_utilization", None)
    if share is not None and not 0 < share <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {share}")
    prefill = getattr(args, "cuda_graph_max_prefill", None)
    if prefill is not None and prefill != 0 and prefill < 16:
        raise ValueError(f"--cuda-graph-max-prefill must be 0 (eager) or at least 16, got {prefill}")


def _check_policies(args: argparse.Namespace) -> None:
    from ..policies import registry  # the package registers every policy on import
    for flag, kind, name in (("--routing-policy", "routing", args.routing_policy),
                             ("--ep-policy", "ep_width", args.ep_policy),
                             ("--microbatch", "microbatch", args.microbatch)):
        if name is not None and name not in registry.names(kind):
            raise ValueError(f"{flag} {name!r} is not a known policy; known: "
                             f"{', '.join(registry.names(kind))}")


def _check_device(device: str) -> None:
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if device == "cpu":
        return
    import torch
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no usable CUDA device "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")


def _check_model(model: str | None, max_model_len: int) -> None:
    if model is None:
        return  # the tiny model, built on first use
    config = os.path.join(model, "config.json")
    if not os.path.isfile(config):
        raise ValueError(f"--model {model}: not a model folder (no config.json there; a "
                         "Hugging Face model folder is expected)")
    try:
        with open(config) as f:
            context = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {model}: config.json cannot be read ({e})") from None
    if max_model_len and isinstance(context, int) and max_model_len > context:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context of "
                         f"{context} tokens")


def _check_bind(host: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve to an address ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"--port {port}: {host}:{port} is already in use") from None
            raise ValueError(f"--host {host} --port {port}: cannot bind ({e.strerror})") from None
