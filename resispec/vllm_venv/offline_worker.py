"""vLLM's offline LLM on token-id prompts: a standalone script run by the ISOLATED venv's python (never imported by
resispec; it imports only vLLM and the standard library). `resispec.data.regen` writes a request JSON, runs
`<venv python> offline_worker.py request.json result.json` and reads the result.

request: {model, dtype, prompts: [[ids]], max_new_tokens, temperature, top_p, top_k, seed, eos_token_id,
          engine_args (more LLM(...) arguments)}
result: {responses: [[ids]] (cut after the first eos, eos kept), seconds (generation only), version}
"""

import json
import sys
import time


def main(request_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    with open(request_path) as f:
        req = json.load(f)
    engine_args = {"enforce_eager": req.get("enforce_eager", True), **req.get("engine_args", {})}
    llm = LLM(model=req["model"], dtype=req["dtype"], seed=req["seed"], **engine_args)
    greedy = req["temperature"] <= 0
    params = [
        SamplingParams(
            max_tokens=req["max_new_tokens"],
            temperature=0.0 if greedy else req["temperature"],
            top_p=1.0 if greedy else req["top_p"],
            top_k=-1 if greedy or req["top_k"] <= 0 else req["top_k"],
            seed=None if greedy else req["seed"] * 1_000_003 + i,
        )
        for i in range(len(req["prompts"]))
    ]
    prompts = [{"prompt_token_ids": list(p)} for p in req["prompts"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    eos = req.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)  # one id or several
    responses = []
    for out in outs:
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        ends = [ids.index(e) for e in eos if e in ids]
        if ends:
            ids = ids[: min(ends) + 1]
        elif eos and comp.finish_reason == "stop":
            ids.append(eos[0])  # stopped on eos without returning it: keep eos, as the built-in engine does
        responses.append(ids)
    with open(result_path, "w") as f:
        json.dump({"responses": responses, "seconds": seconds, "version": vllm.__version__}, f)


if __name__ == "__main__":  # vLLM's offline API spawns processes: it must run under this guard
    main(sys.argv[1], sys.argv[2])
