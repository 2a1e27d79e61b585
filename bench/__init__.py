"""specdec_kit.bench: benchmarks (speedup per method, runtime overhead, engine backends, serving load, client-server drafting) and their reports."""
