"""Session 75's feature-combination fuzz over HTTP: random completion / chat bodies, each with a random set of API
features, sent to a plain server (no cache, no speculation, a big L1) and to a featured one (speculation, a small
L1 with L2/L3, chunked prefill, few running slots), some concurrently; the featured server's answer (whole and
streamed) must equal the plain one's."""
from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import sys

from http_fuzz_cases import make_tokenizer
from http_fuzz_run import asgi_call
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.speculative import SpeculativeConfig

DEBUG = bool(os.environ.get("DEBUG"))
TEXTS = ["abc abc abc abc ", "The cat and the dog and the cat ", "Answer: ", "1 2 3 4 5 6 7 8 9 ",
         "hello world hello world hello "]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "kind": {"enum": ["cat", "dog"]}},
          "required": ["n", "kind"], "additionalProperties": False}


def make_app(rng, featured: bool, tokenizer, parser: bool):
    if featured:
        ps = rng.choice([1, 2, 4, 8])
        cfg = EngineConfig(model="tiny", device="cpu", page_size=ps, num_pages=rng.choice([40, 60, 200]) * 4 // ps,
                           max_prefill_tokens=rng.choice([7, 16, 2048]), max_running_requests=rng.choice([2, 3, 64]),
                           overlap_schedule=rng.random() < 0.7, scheduling_policy="priority",
                           share_prefill=rng.random() < 0.7,
                           speculative=SpeculativeConfig(num_speculative_tokens=rng.choice([2, 4, 7]),
                                                         prompt_lookup_max=3, prompt_lookup_min=1,
                                                         draft_policy="always") if rng.random() < 0.8 else None)
        if rng.random() < 0.7:
            cfg = cfg.with_hicache(enable=True, policy="always", prefetch=rng.random() < 0.5, transfer_backend="torch")
    else:
        cfg = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=2048, scheduling_policy="priority",
                           enable_prefix_cache=False)
    eng = Engine(cfg)
    limits = ServerLimits(shutdown_grace_s=1.0, reasoning_parser="qwen3" if parser else None)
    return eng, create_app(eng, limits, tokenizer=tokenizer)


def draw_body(rng, chat: bool) -> dict:
    text = rng.choice(TEXTS) * rng.choice([1, 2]) + "".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(6)))
    body: dict = {"model": "tiny"}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text if rng.random() < 0.8 else [text, rng.choice(TEXTS)]
    mt = rng.choice([1, 2, 5, 9, 16] + ([] if chat else [None]))  # (a chat's default: the context's rest)
    if mt is not None:
        body["max_completion_tokens" if chat and rng.random() < 0.5 else "max_tokens"] = mt
    r = rng.random()
    if r < 0.6:
        body["temperature"] = 0
    elif r < 0.8:
        body.update(temperature=0.9, seed=rng.randrange(100))
    else:
        body.update(temperature=0.9, top_k=1)
    if rng.random() < 0.3:
        body["n"] = rng.choice([2, 3])
    if rng.random() < 0.3:
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = rng.choice([0, 2])
        else:
            body["logprobs"] = rng.choice([0, 2])
    if not chat and rng.random() < 0.25:
        body["echo"] = True
        if rng.random() < 0.3 and "logprobs" in body:
            body["max_tokens"] = 0
    if rng.random() < 0.15:
        body["prompt_logprobs"] = rng.choice([0, 1])
    if rng.random() < 0.25:
        body["stop"] = rng.choice([["a"], [" "], ["c", "t"], "at", ["hello"], ["1"], "e "])
    if rng.random() < 0.15:
        body["stop_token_ids"] = [rng.randrange(32, 127)]
    if rng.random() < 0.2:
        body["include_stop_str_in_output"] = True
    if rng.random() < 0.15 and body.get("max_tokens", body.get("max_completion_tokens", 16)):
        body["min_tokens"] = rng.randrange(0, (body.get("max_tokens") or body.get("max_completion_tokens") or 16) + 1)
    g = rng.random()
    if g < 0.08:
        body["guided_regex"] = rng.choice(["[a-z ]{3,20}", "(ab|cd)+x", "[0-9]+"])
    elif g < 0.14:
        body["guided_choice"] = ["alpha beta", "alpha gamma", "omega"]
    elif g < 0.2:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    elif g < 0.23:
        body["response_format"] = {"type": "json_object"}
    if g < 0.23 and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 16  # (a grammar that never ends would run to the context's end)
    if rng.random() < 0.15:
        body["presence_penalty"] = rng.choice([0.5, 1.5])
        body["repetition_penalty"] = rng.choice([1.0, 1.3])
    if rng.random() < 0.1:
        body["logit_bias"] = {str(rng.randrange(32, 127)): rng.choice([-100, 5, 100])}
    if rng.random() < 0.1:
        body["bad_words"] = [rng.choice(["a", "c", "he", " t"])]
    if rng.random() < 0.08:
        body["allowed_token_ids"] = sorted({rng.randrange(32, 127) for _ in range(10)})
    if rng.random() < 0.2:
        body["priority"] = rng.randrange(-2, 3)
    if rng.random() < 0.1:
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body["use_beam_search"] = True
    if rng.random() < 0.1:
        body["return_token_ids"] = True
    if chat and rng.random() < 0.15:
        body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    return body


def rounded(x):
    if isinstance(x, float):
        return x
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 2e-3
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def first_diff(a, b, path="") -> str:
    if type(a) is not type(b):
        return f"{path}: {a!r:.300} vs {b!r:.300}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b), key=str):
            if not same(a.get(k, "<absent>"), b.get(k, "<absent>")):
                return first_diff(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}.{k}")
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: len {len(a)} vs {len(b)}: {a!r:.600} vs {b!r:.600}"
        for i, (x, y) in enumerate(zip(a, b)):
            if not same(x, y):
                return first_diff(x, y, f"{path}[{i}]")
    return f"{path}: {a!r:.300} vs {b!r:.300}"


def normalize(reply) -> object:
    if reply.status != 200:
        try:
            err = json.loads(reply.body)["error"]
            return (reply.status, err.get("param"), err.get("code"))
        except Exception:  # noqa: BLE001
            return (reply.status, reply.body[:200])
    data = json.loads(reply.body)
    data.pop("id", None)
    data.pop("created", None)
    data.pop("system_fingerprint", None)
    u = data.get("usage") or {}
    u.pop("prompt_tokens_details", None)
    u.pop("cached_tokens_per_tier", None)
    return rounded(data)


def merge_stream(reply, chat: bool) -> object:
    """The streamed answer as the whole one's choices' main fields."""
    if reply.status != 200:
        return normalize(reply)
    choices: dict = {}
    usage = None
    errors = []
    for ev in reply.events:
        if ev == "[DONE]":
            continue
        if "error" in ev:
            errors.append(ev["error"].get("code"))
            continue
        if ev.get("usage") and not ev.get("choices"):
            usage = ev["usage"]
        for c in ev.get("choices", []):
            acc = choices.setdefault(c["index"], {"text": "", "reasoning": "", "finish_reason": None, "n_lp": 0,
                                                  "token_ids": []})
            if chat:
                d = c.get("delta", {})
                acc["text"] += d.get("content") or ""
                acc["reasoning"] += d.get("reasoning_content") or ""
                lp = (c.get("logprobs") or {}).get("content") or []
            else:
                acc["text"] += c.get("text", "")
                lp = (c.get("logprobs") or {}).get("tokens") or []
            acc["n_lp"] += len(lp)
            acc["token_ids"] += c.get("token_ids") or []
            if ev.get("usage") is not None:
                acc["cu"] = ev["usage"]["completion_tokens"]
            if c.get("finish_reason"):
                acc["finish_reason"] = c["finish_reason"]
    if errors:
        return ("stream error", errors)
    for acc in choices.values():
        cu = acc.pop("cu", None)
        if cu is not None and acc["token_ids"] and cu != len(acc["token_ids"]):
            acc["continuous usage"] = (cu, len(acc["token_ids"]))
    if usage:
        usage = {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


def whole_as_stream(data, chat: bool) -> object:
    if not isinstance(data, dict):
        return data
    out = []
    for c in data["choices"]:
        if chat:
            m = c["message"]
            lp = (c.get("logprobs") or {}).get("content") or []
            out.append({"text": m.get("content") or "", "reasoning": m.get("reasoning_content") or "",
                        "finish_reason": c["finish_reason"], "n_lp": len(lp), "token_ids": c.get("token_ids") or []})
        else:
            lp = (c.get("logprobs") or {}).get("tokens") or []
            out.append({"text": c["text"], "reasoning": "", "finish_reason": c["finish_reason"], "n_lp": len(lp),
                        "token_ids": c.get("token_ids") or []})
    u = data.get("usage")
    return {"choices": out, "usage": {k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}


def comparable(body) -> bool:
    return body.get("temperature") == 0 or "seed" in body or body.get("top_k") == 1


def toggle(rng, chat: bool, body: dict) -> tuple[str, dict]:
    v = copy.deepcopy(body)
    kinds = ["logprobs", "n", "prompt_logprobs", "priority", "return_token_ids", "batch"]
    if not chat:
        kinds.append("echo")
    kind = rng.choice(kinds)
    if kind == "logprobs":
        if "logprobs" in v:
            v.pop("logprobs")
            v.pop("top_logprobs", None)
        elif chat:
            v.update(logprobs=True, top_logprobs=2)
        else:
            v["logprobs"] = 2
    elif kind == "n":
        v["n"] = 1 if v.get("n", 1) > 1 else 3
    elif kind == "prompt_logprobs":
        if "prompt_logprobs" in v:
            v.pop("prompt_logprobs")
        else:
            v["prompt_logprobs"] = 1
    elif kind == "priority":
        v["priority"] = -v.get("priority", 1) or 2
    elif kind == "return_token_ids":
        v["return_token_ids"] = not v.get("return_token_ids")
    elif kind == "batch":
        if chat or not isinstance(v["prompt"], str):
            return "", v
        v["prompt"] = [v["prompt"], "Answer: x"] if rng.random() < 0.5 else ["Answer: x", v["prompt"]]
    elif kind == "echo":
        v["echo"] = not v.get("echo")
        if not v["echo"] and v.get("max_tokens") == 0:
            return "", v
    return kind, v


async def metamorphic(rng, app, chat: bool, body: dict, base: dict, where: str) -> list[str]:
    """One feature toggled that changes no token: the answer's choices as the base's (projected)."""
    kind, v = toggle(rng, chat, body)
    if not kind:
        return []
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = await asgi_call(app, path, json.dumps(v).encode())
    if r.status != 200:
        if kind in ("logprobs", "n", "prompt_logprobs", "echo", "batch") and r.status == 400:
            return []  # (beam search refuses logprobs; echo's max_tokens 0; ...)
        return [f"{where}: toggled {kind}: status {r.status} {r.body[:300]}"]
    got = whole_as_stream(normalize(r), chat)
    want = copy.deepcopy(base)
    bn, vn = body.get("n", 1) or 1, v.get("n", 1) or 1
    gc, wc = got["choices"], want["choices"]
    for c in gc + wc:
        c.pop("n_lp")
        if kind == "return_token_ids":
            c.pop("token_ids")
    if kind == "batch":
        first = v["prompt"][0] == body["prompt"]
        gc = gc[:vn] if first else gc[vn:]
        got["usage"] = want["usage"] = None
    if kind == "n":
        if "seed" not in body and body.get("top_k") != 1 and body.get("temperature") != 0:
            return []
        if body.get("use_beam_search"):
            return []
        want_n = wc[:1] * vn if "seed" not in body else wc[:1]
        gc = gc if "seed" not in body else gc[:1]
        wc = want_n
        if isinstance(body.get("prompt"), list):
            return []
        got["usage"] = want["usage"] = None
    if kind == "echo":
        for g_, w_ in zip(gc, wc):
            if v.get("echo"):
                g_["text"] = g_["text"][len(g_["text"]) - len(w_["text"]):] if g_["text"].endswith(w_["text"]) \
                    else g_["text"]
            else:
                w_["text"] = w_["text"][len(w_["text"]) - len(g_["text"]):] if w_["text"].endswith(g_["text"]) \
                    else w_["text"]
    got["choices"], want["choices"] = gc, wc
    if not same(got, want):
        return [f"{where}: toggled {kind} ({json.dumps(v)}): {first_diff(want, got)}"]
    return []


async def run_case(seed: int) -> list[str]:
    rng = random.Random(seed)
    tokenizer = make_tokenizer("hf")
    parser = rng.random() < 0.3
    plain_eng, plain = make_app(rng, False, tokenizer, parser)
    feat_eng, feat = make_app(rng, True, tokenizer, parser)
    problems = [f"featured engine: {feat_eng.config}"]
    async with plain.router.lifespan_context(plain), feat.router.lifespan_context(feat):
        for _ in range(rng.choice([1, 2, 3])):
            calls = []
            for _ in range(rng.randrange(1, 6)):
                chat = rng.random() < 0.4
                calls.append((chat, draw_body(rng, chat)))
            want = []
            for chat, body in calls:
                path = "/v1/chat/completions" if chat else "/v1/completions"
                if DEBUG:
                    print("plain", path, json.dumps(body), flush=True)
                want.append(await asgi_call(plain, path, json.dumps(body).encode()))
            jobs, extra = [], []
            for chat, body in calls:
                path = "/v1/chat/completions" if chat else "/v1/completions"
                jobs.append(asgi_call(feat, path, json.dumps(body).encode()))
                sbody = copy.deepcopy(body)
                sbody["stream"] = True
                sbody["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
                sbody.pop("prompt_logprobs", None)  # (a 400 with a stream, vLLM's)
                jobs.append(asgi_call(feat, path, json.dumps(sbody).encode()))
                if rng.random() < 0.5:
                    leave = rng.choice([("events", rng.randrange(1, 4)), ("after_s", rng.choice([0.0, 0.01, 0.05]))])
                    extra.append(asgi_call(feat, path, json.dumps(sbody if rng.random() < 0.7 else body).encode(),
                                           disconnect=leave, spec=rng.choice(["2.3", "2.4"])))
            try:
                got = await asyncio.wait_for(asyncio.gather(*jobs, *extra), 120)
                for r in got[len(jobs):]:
                    if r.raised is not None and not r.disconnected or (r.sent_status or 0) >= 500 and \
                            b"aborted" not in r.sent_body and b"engine_error" not in r.sent_body:  # (bans vs grammar)
                        problems.append(f"disconnect: {r.raised!r} {r.sent_status} {r.sent_body[:300]}")
                got = got[:len(jobs)]
            except asyncio.TimeoutError:
                problems.append(f"hang: {calls}")
                return problems
            for k, (chat, body) in enumerate(calls):
                w, g, s = want[k], got[2 * k], got[2 * k + 1]
                where = f"{'chat' if chat else 'completion'} {json.dumps(body)}"
                if w.raised or g.raised or s.raised:
                    problems.append(f"{where}: raised {w.raised!r} {g.raised!r} {s.raised!r}")
                    continue
                ms = merge_stream(s, chat)
                s_failed = s.status == 500 or isinstance(ms, tuple) and ms[0] == "stream error"
                if (w.status == 500) != (g.status == 500) or (g.status == 500) != s_failed:
                    problems.append(f"{where}: 500 {w.body[:300]} {g.body[:300]} {s.body[:300]}")
                    continue
                if w.status == 500:
                    continue
                nw, ng = normalize(w), normalize(g)
                if not comparable(body):
                    if w.status != g.status:
                        problems.append(f"{where}: status {w.status} vs {g.status}: {w.body[:300]} {g.body[:300]}")
                    continue
                if not same(nw, ng):
                    problems.append(f"{where}:\n   plain vs feat: {first_diff(nw, ng)}")
                    continue
                ww = whole_as_stream(nw, chat)
                if not same(ms, ww):
                    problems.append(f"{where}: stream\n   whole vs stream: {first_diff(ww, ms)}")
                if w.status == 200:
                    problems += await metamorphic(rng, feat, chat, body, ww, where)
            for _ in range(200):
                if not feat_eng.requests:
                    break
                await asyncio.sleep(0.01)
            feat_eng.check_integrity()
            if feat_eng.requests:
                problems.append(f"requests left: {list(feat_eng.requests)}")
    return problems if len(problems) > 1 else []


if __name__ == "__main__":
    from combo_fuzz_s75 import run_seeds

    print(f"{run_seeds(run_case, sys.argv)} failed")
