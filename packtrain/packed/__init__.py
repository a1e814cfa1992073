"""The packed computation: layout, attention, Gated DeltaNet, context modes, P's state, groups, walk, kernels and
the patch. It never imports the run (packtrain.run, packtrain.rundir, packtrain.models, ...): tests/test_structure.py."""
