"""A loop that lives as long as the app: started on startup, cancelled and awaited on cleanup."""
from __future__ import annotations

import asyncio


class BackgroundLoop:
    task_name = "background"
    _task: asyncio.Task | None = None

    async def start(self, _app=None) -> None:
        self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def close(self, _app=None) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        raise NotImplementedError
