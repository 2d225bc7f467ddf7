"""The in-process batch API, mixed into the Engine: `await engine.generate_async(prompts, params)` and
its synchronous form `engine.generate(prompts, params)`, which runs the engine on a private uvloop
loop and stops it after. Each prompt is one request through `add_request`; a prompt the engine
refuses gets a result carrying its error, and the others run. Uses the Engine's `start`,
`add_request`, `abort`, `stop_loop`, `cache` and `_loop_task`."""
from __future__ import annotations

import asyncio
import numbers
from collections.abc import Sequence

from scheduler.loop_task import check_loop
from scheduler.request import GenerationResult, Request, RequestError, SamplingParams


class BatchAPI:
    async def generate_async(self, prompts: Sequence[Sequence[int]],
                             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, numbers.Integral) for t in prompts)):
            # (regression: each of one prompt's token ids, or each character of a text, failed as a prompt)
            raise ValueError("prompts is a list of prompts, each a list of token ids: give one prompt as [prompt]"
                             + (" (a text is tokenized first: this API takes token ids)" if isinstance(prompts, str)
                                else ""))
        await self.start()
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):  # (zip would drop prompts silently)
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling parameters")
        reqs: list[Request | GenerationResult] = []
        out = []
        try:
            for prompt, p in zip(prompts, plist):
                try:
                    reqs.append(self.add_request(prompt, p))
                except RequestError as exc:
                    reqs.append(GenerationResult(rid="", prompt_tokens=len(prompt) if hasattr(prompt, "__len__") else 0,
                                                 output_ids=[], finish_reason="error", error=str(exc),
                                                 cached_tokens=dict.fromkeys(("l1", "l2", "l3"), 0),
                                                 ttft_s=None, latency_s=None,
                                                 logprobs=None if getattr(p, "logprobs", None) is None else [],
                                                 # (as a request that failed later: regression, None where asked)
                                                 prompt_logprobs=None if getattr(p, "prompt_logprobs", None) is None
                                                 else []))
            for r in reqs:
                if isinstance(r, Request):
                    while not r.state.done:
                        ev = await r.queue.get()
                        if ev.finished:
                            break
                    out.append(r.result())
                else:
                    out.append(r)
        except BaseException:  # nobody waits for them any more: as submit() does, abort them (regression:
            # a prompt that failed to queue, other than by a RequestError, left those before it queued)
            for r in reqs:
                if isinstance(r, Request) and not r.state.done:
                    await self.abort(r.rid)
            raise
        return out

    def generate(self, prompts, params=None) -> list[GenerationResult]:
        """Synchronous batch generation on a private uvloop loop; inside a running event loop (a
        Jupyter notebook's), `await engine.generate_async(...)` instead."""
        import uvloop

        if asyncio._get_running_loop() is not None:  # (regression: asyncio.run's error, and a
            # RuntimeWarning for the coroutine built here and never awaited)
            raise RuntimeError("Engine.generate() cannot run inside a running event loop (a Jupyter notebook "
                               "runs one): use `await engine.generate_async(prompts, params)`")
        check_loop(self._loop_task, None)

        async def run():
            try:
                return await self.generate_async(prompts, params)
            finally:
                try:
                    try:
                        await self.stop_loop()
                    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                        # (Ctrl-C as it drained: asyncio.run cancelled it, or a second one landed in this code)
                        # nothing of the engine may stay pending on this loop, which ends now (regression: a backup's
                        # L3 write was settling; destroyed with the loop, its pages never came back, and every later
                        # generate() raised ValueError from its drain): the loop ends, the backups not yet written
                        # are dropped, copies in flight settle, then the cancellation or the interrupt goes on
                        await self.stop_loop(cancel_ops=True)
                        raise
                finally:  # (also after a crash, which stop_loop raises: regression, Redis' client was left open)
                    await self.cache.release_loop()
        return uvloop.run(run())
