"""The serving side: Qwen3 model, paged attention, requests, batching and the asyncio loop."""
