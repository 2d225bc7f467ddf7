"""Session 75: Responses API bodies with random features, whole vs streamed vs background (then GET), on a featured
engine (speculation, hicache, small L1): the same output text, usage and status."""
from __future__ import annotations

import asyncio
import json
import random
import sys

import httpx

from http_fuzz_cases import make_tokenizer
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.speculative import SpeculativeConfig

TEXTS = ["abc abc abc abc ", "The cat and the dog and the cat ", "Answer: ", "hello world hello world hello "]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get", "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                                            "required": ["q"]}}]


def draw(rng) -> dict:
    b = {"model": "tiny", "input": rng.choice(TEXTS) + rng.choice(["", "x", "ab"]), "temperature": 0,
         "max_output_tokens": rng.choice([1, 3, 8, 16])}
    if rng.random() < 0.3:
        b["instructions"] = "be brief"
    if rng.random() < 0.3:
        b["include"] = ["message.output_text.logprobs"]
        b["top_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.2:
        b["text"] = {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}
    if rng.random() < 0.2:
        b["tools"] = TOOLS
        b["tool_choice"] = rng.choice(["required", {"type": "function", "name": "get"}, "none"])
    if rng.random() < 0.2:
        b.update(temperature=0.9, seed=rng.randrange(50))
    if rng.random() < 0.15:
        b["top_k"] = 1
        b["temperature"] = 0.8
    if rng.random() < 0.2:
        b["logit_bias"] = {str(rng.randrange(32, 127)): rng.choice([-100, 10])}
    if rng.random() < 0.2:
        b["priority"] = rng.randrange(-1, 2)
    if rng.random() < 0.2:
        b["reasoning"] = {"effort": "low"}
    return b


def essence(resp: dict) -> object:
    out = []
    for item in resp.get("output", []):
        if item["type"] == "message":
            for part in item["content"]:
                out.append(("text", part.get("text"), len(part.get("logprobs") or [])))
        elif item["type"] == "function_call":
            out.append(("call", item["name"], item["arguments"]))
        elif item["type"] == "reasoning":
            out.append(("reasoning", json.dumps(item.get("content") or item.get("summary"))))
    u = resp.get("usage") or {}
    return resp.get("status"), out, u.get("input_tokens"), u.get("output_tokens"), \
        (resp.get("incomplete_details") or {}).get("reason")


async def run_case(seed: int) -> list[str]:
    rng = random.Random(seed)
    ps = rng.choice([1, 2, 4])
    cfg = EngineConfig(model="tiny", device="cpu", page_size=ps, num_pages=rng.choice([60, 200]) * 4 // ps,
                       max_prefill_tokens=rng.choice([7, 2048]), max_running_requests=rng.choice([2, 64]),
                       scheduling_policy="priority",
                       speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1,
                                                     draft_policy="always") if rng.random() < 0.7 else None)
    if rng.random() < 0.6:
        cfg = cfg.with_hicache(enable=True, policy="always", transfer_backend="torch")
    eng = Engine(cfg)
    parser = rng.random() < 0.5
    app = create_app(eng, ServerLimits(shutdown_grace_s=1.0, reasoning_parser="qwen3" if parser else None,
                                       tool_call_parser=None), tokenizer=make_tokenizer("hf"))
    problems = []
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            prev = None
            for _ in range(rng.randrange(1, 5)):
                b = draw(rng)
                if prev is not None and rng.random() < 0.4:
                    b["previous_response_id"] = prev
                whole = await c.post("/v1/responses", json=b)
                sb = dict(b, stream=True)
                bg = dict(b, background=True)
                sr, br = await asyncio.gather(c.post("/v1/responses", json=sb), c.post("/v1/responses", json=bg))
                where = json.dumps(b)
                if whole.status_code != 200:
                    if whole.status_code == 500 or sr.status_code != whole.status_code:
                        problems.append(f"{where}: {whole.status_code} {whole.text[:300]} stream {sr.status_code}")
                    continue
                w = whole.json()
                prev = w["id"] if rng.random() < 0.8 else prev
                final = None
                for block in sr.text.split("\n\n"):
                    for line in block.split("\n"):
                        if line.startswith("data: "):
                            ev = json.loads(line[6:])
                            if ev.get("type") in ("response.completed", "response.incomplete", "response.failed"):
                                final = ev["response"]
                if final is None:
                    problems.append(f"{where}: stream had no end: {sr.text[-500:]}")
                    continue
                if br.status_code != 200:
                    problems.append(f"{where}: background {br.status_code} {br.text[:300]}")
                    continue
                rid = br.json()["id"]
                for _ in range(600):
                    g = (await c.get(f"/v1/responses/{rid}")).json()
                    if g.get("status") not in ("queued", "in_progress"):
                        break
                    await asyncio.sleep(0.02)
                comparable = b.get("temperature") == 0 or "seed" in b or b.get("top_k") == 1
                if not comparable:
                    continue
                ew, es, eg = essence(w), essence(final), essence(g)
                if ew != es:
                    problems.append(f"{where}: whole vs stream\n  {ew}\n  {es}")
                if ew != eg:
                    problems.append(f"{where}: whole vs background\n  {ew}\n  {eg}")
            eng.check_integrity()
    return problems


if __name__ == "__main__":
    from combo_fuzz_s75 import run_seeds

    print(f"{run_seeds(run_case, sys.argv)} failed")
