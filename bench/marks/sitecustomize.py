"""Marks on a text or image request's path, in the gateway and the prefill worker, for `bench/mesh.py` runs.

    cp bench/marks/sitecustomize.py .venv/lib/python3.11/site-packages/ && mkdir -p /tmp/marks
    EPD_MARKS=1 python -m bench.mesh --requests 80 --no-toggle-route --against DIR
    rm .venv/lib/python3.11/site-packages/sitecustomize.py

Every process of the environment loads it; only a gateway or a prefill worker started with EPD_MARKS set patches
anything. Each writes its rows to /tmp/marks/PID.json (gateway: ms from HTTP in to the Prefill call, to its reply,
to the first output, to `start` returning, to the first byte written, and whether it had an image; worker wPID.json:
ms in the Prefill method, in engine steps, steps, images, prompt tokens). Not imported by anything of the project.
"""

import os
import sys

if "gateway" in sys.argv and os.environ.get("EPD_MARKS"):
    import importlib
    import json
    import statistics
    import time

    pc = time.perf_counter
    state = {"reply": None, "rebased": None, "start": None, "rows": [], "arrive": None, "call": None}
    import starlette.applications as sa

    orig_sa = sa.Starlette.__call__

    async def sa_call(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].endswith("completions"):
            state["arrive"] = pc()
        return await orig_sa(self, scope, receive, send)

    sa.Starlette.__call__ = sa_call

    def dump():
        rows = state["rows"]
        if rows:
            med = [statistics.median(r[i] for r in rows[10:] or rows) for i in range(5)]
            json.dump(
                {"rows": rows, "n": len(rows), "median_ms": med, "cwd": os.getcwd(), "path": sys.path[:3]},
                open(f"/tmp/marks/{os.getpid()}.json", "w"),
            )

    from services.stage_calls import client as sc

    orig_call = sc.StageCalls.call

    def call(self, address, kind, message, *a, **k):
        fut = orig_call(self, address, kind, message, *a, **k)
        if kind == "encode":
            state["image"] = True
        if kind == "prefill":
            state["call"] = pc()
            fut.add_done_callback(lambda f: state.__setitem__("reply", pc()))
        return fut

    sc.StageCalls.call = call
    for name in ("services.gateway.mesh.migration", "services.gateway.migration"):
        try:
            mig = importlib.import_module(name)
        except ImportError:
            continue
        orig_rebased = mig.rebased

        def rebased(out, *a, **k):
            if len(out.output_token_ids) == 1 and state["rebased"] is None:
                state["rebased"] = pc()
            return orig_rebased(out, *a, **k)

        mig.rebased = rebased
        for m in list(sys.modules.values()):
            if getattr(m, "rebased", None) is orig_rebased:
                m.rebased = rebased
    for name in ("services.gateway.mesh.backend", "services.gateway.mesh"):
        try:
            mod = importlib.import_module(name)
            MB = mod.MeshBackend
        except (ImportError, AttributeError):
            continue
        orig_start = MB.start

        async def start(self, *a, **k):
            r = await orig_start(self, *a, **k)
            state["start"] = pc()
            return r

        MB.start = start
        break
    from services.gateway import event_stream as es

    orig_es = es.EventStream.__call__

    async def es_call(self, scope, receive, send):
        first = [True]

        async def send2(msg):
            await send(msg)
            if first[0] and msg["type"] == "http.response.body":
                first[0] = False
                if state["reply"] and state["rebased"] and state["start"] and state["arrive"] and state["call"]:
                    now = pc()
                    marks = [state[k] for k in ("arrive", "call", "reply", "rebased", "start")] + [now]
                    state["rows"].append([(b - a) * 1e3 for a, b in zip(marks, marks[1:])] + [bool(state.get("image"))])
                    if len(state["rows"]) % 20 == 0:
                        dump()
                state["image"] = False
                state["reply"] = state["rebased"] = state["start"] = None

        return await orig_es(self, scope, receive, send2)

    es.EventStream.__call__ = es_call
if (
    "worker" in sys.argv
    and os.environ.get("EPD_MARKS")
    and "--roles" in sys.argv
    and "P" in sys.argv[sys.argv.index("--roles") + 1]
):
    import json
    import time

    pc = time.perf_counter
    W = {"rows": [], "steps": []}
    from services.prefill import servicer as ps

    orig_p = ps.PrefillServicer.prefill

    async def prefill(self, request):
        t0 = pc()
        W["steps"] = []
        r = await orig_p(self, request)
        t1 = pc()
        W["rows"].append(
            [
                (t1 - t0) * 1e3,
                sum(W["steps"]) * 1e3,
                len(W["steps"]),
                bool(request.request.images),
                len(request.request.prompt_token_ids) if hasattr(request.request, "prompt_token_ids") else -1,
            ]
        )
        if len(W["rows"]) % 20 == 0:
            json.dump(
                {"cwd": os.getcwd(), "argv": sys.argv[:6], "rows": W["rows"]},
                open(f"/tmp/marks/w{os.getpid()}.json", "w"),
            )
        return r

    ps.PrefillServicer.prefill = prefill
    from common.engine import engine as ee

    orig_step = ee.Engine.step

    def step(self):
        t = pc()
        out = orig_step(self)
        W["steps"].append(pc() - t)
        return out

    ee.Engine.step = step
