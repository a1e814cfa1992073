"""The packed computation: layout, attention, Gated DeltaNet, context modes, P's state, groups, walk, kernels, the patch."""
