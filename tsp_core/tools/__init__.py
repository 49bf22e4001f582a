"""Commands on top of everything: the ``tsp`` CLI (:mod:`.cli`: simulate, bench, plan),
the training and generation benchmarks (:mod:`.bench`, :mod:`.bench_generate`) and the GPU
acceptance checks (:mod:`.gpu_check`, ``python -m tsp_core.tools.gpu_check``)."""
