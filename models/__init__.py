"""Model definitions in plain torch (Qwen3-MoE first; dense Qwen3/Llama as the
no-expert case: `qwen3_moe`), Hugging Face loading that reads only a rank's slices
(`loader`, `checkpoint`), a rank's shard (`shard`) and its parallel parts (`parallel`),
and the tiny default model generator (`tiny`). Depends on `kernels` and `config`."""
