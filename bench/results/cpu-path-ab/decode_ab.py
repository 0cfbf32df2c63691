"""Median engine.step() wall time decoding one request at a 512-token context (default model, none drafter)."""
import statistics, sys, time
import torch
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.wire import EngineRequest, SamplingParams
from drafters.config import SpecConfig
torch.manual_seed(0)
engine = Engine(EngineConfig(spec=SpecConfig(drafter="none")))
prompt = [1] + torch.randint(100, 40000, (511,)).tolist()
engine.add_request(EngineRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)))
times = []
while engine.has_work:
    start = time.perf_counter(); engine.step(); times.append(time.perf_counter() - start)
decode = times[5:]
print(sys.argv[1], "decode step ms median %.2f p25 %.2f p75 %.2f n=%d" % (
    statistics.median(decode) * 1e3, statistics.quantiles(decode, n=4)[0] * 1e3, statistics.quantiles(decode, n=4)[2] * 1e3, len(decode)))
