"""The report's sections: what each measures and how its process is set up."""

# section -> (module, simulated CPU devices in the section's process, what it measures)
SECTIONS: dict[str, tuple[str, int, str]] = {
    "decode": ("decode", 1, "decode step vs the machine's floor"),
    "memory": ("memory", 1, "peak RSS of a pp=2 stage worker"),
    "transfer": ("transfer", 1, "cross-process activation transfer vs raw ZMQ"),
    "executors": ("executors", 1, "Ray / compiled-graph vs in-process step time"),
    "pipeline": ("pipeline", 2, "pp=2 with 2 batches in flight vs 1"),
    "throughput": ("throughput", 1, "output tokens/s vs transformers, and vs concurrency"),
    "coldstart": ("coldstart", 0, "cold start of pipejax generate"),
}
