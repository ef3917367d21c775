"""Diagnostic: one SlotCache prefill + decode on a 2-layer 8B-shaped model at 32k, full traceback."""
import sys, traceback, torch
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import kvpass
from bench_decode_step import llama8b
m = llama8b(2)
ids = torch.randint(10, 128000, (1, 32768), device="cuda")
for pol in ("full", "streamingllm"):
    torch._dynamo.reset()
    be = kvpass.backend(pol, **({} if pol == "full" else {"budget": 2048}))
    fwd = torch.compile(m.forward, backend=be, mode="reduce-overhead")
    cache = kvpass.SlotCache(m, be, max_length=32768 + 80, max_new_tokens=80)
    try:
        with torch.no_grad():
            l = fwd(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            print(pol, "prefill ok", torch.cuda.max_memory_allocated() / 2**30, flush=True)
            for i in range(3):
                torch.compiler.cudagraph_mark_step_begin()
                l = fwd(input_ids=l[:, -1:].argmax(-1), position_ids=torch.tensor([[32768 + i]], device="cuda"),
                        past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            print(pol, "decode ok", cache.seen, be.plans(), [(r.phase, r.cudagraphs) for r in be.reports], flush=True)
    except Exception:
        traceback.print_exc(limit=-12)
