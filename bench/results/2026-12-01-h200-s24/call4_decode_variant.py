# bench decode with the fused sampler's chunks on or off: python3 out/decode_variant.py on|off ARGS...
import sys

from loraplane.worker.kernels import sampling

if sys.argv[1] == "off":
    sampling.CHUNK_PROGRAMS = 0
from loraplane.worker.bench.decode import main

sys.exit(main(sys.argv[2:]))
