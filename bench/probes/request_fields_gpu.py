"""The sampler's allow-lists, bad words and cache salts on the device against the CPU
engine: the same greedy and seeded tokens (tiny model). Prints one line per case."""

from __future__ import annotations

import sys

from phalanx import LLM, SamplingParams
from phalanx.engine.bad_words import bad_words_token_ids
from phalanx.models.tiny import default_model_dir


def main() -> int:
    folder = str(default_model_dir())
    cpu, gpu = LLM(folder, device="cpu"), LLM(folder, device="cuda")
    prompt = cpu.tokenizer.encode("The quick brown fox jumps over the lazy dog and then")
    plain = cpu.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
    words = [cpu.tokenizer.decode(plain[2:4]).strip(), cpu.tokenizer.decode(plain[6:7]).strip()]
    cases = {
        "allowed, sampled": SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True,
                                           allowed_token_ids=sorted(set(plain[:8]) | {5, 9})),
        "bad words, greedy": SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                            bad_words_token_ids=bad_words_token_ids(cpu.tokenizer, words)),
        "allowed EOS + min_tokens": SamplingParams(temperature=0, max_tokens=4, min_tokens=2,
                                                   allowed_token_ids=[cpu.config.model.eos_token_ids[0]]),
        "salted, greedy": SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                         cache_salt="tenant"),
    }
    bad = 0
    for name, params in cases.items():
        want = cpu.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
        got = gpu.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
        bad += got != want
        print(f"{name:28s} {'equal' if got == want else 'DIFFERENT'} {got[:8]}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
