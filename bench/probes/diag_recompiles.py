"""Why a second SlotCache recompiles under ``torch.compile(dynamic=True, mode="reduce-overhead")`` on CUDA
(the decode benchmark's ``graphs`` show two prefill and two decode graphs). A tiny Llama; three caches in
turn, then one reset; prints the backend's graphs after each and Dynamo's recompile reasons."""

import logging
import sys
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import kvpass  # noqa: E402

torch._logging.set_logs(recompiles=True)
logging.getLogger("torch._dynamo").setLevel(logging.INFO)
cfg = tf.LlamaConfig(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
)
model = tf.LlamaForCausalLM(cfg).cuda().eval()
for dynamic, mode in ((True, "reduce-overhead"), (True, None), (None, "reduce-overhead")):
    torch._dynamo.reset()
    be = kvpass.backend("full")
    fwd = torch.compile(model.forward, backend=be, dynamic=dynamic, mode=mode)
    ids = torch.randint(3, 250, (1, 40), device="cuda")
    for i in range(3):
        cache = kvpass.SlotCache(model, be, max_length=64)
        with torch.no_grad():
            fwd(input_ids=ids, past_key_values=cache, use_cache=True)
            fwd(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    print(f"dynamic={dynamic} mode={mode}:", [r.phase for r in be.reports], flush=True)
