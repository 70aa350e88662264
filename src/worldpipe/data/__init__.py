"""worldpipe.data: environments -> episodes -> zarr v3 trajectory store + manifest -> resumable windows.

Modules: ``spec`` (DatasetSpec), ``episodes`` (simulate_episode), ``store`` (init_store, write_shards,
TrajectoryStore, CorruptShardError), ``manifest`` (seal/load/verify/describe), ``build`` (build_dataset),
``sampler`` (GlobalWindowSampler), ``loader`` (WindowLoader). Import from the submodules; this package
imports nothing heavy on its own.
"""
