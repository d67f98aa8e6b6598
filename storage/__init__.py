"""Everything that touches zarr: layouts, manifests, validation.

Every store is a directory holding zarr arrays and a `manifest.json` that is
written last; a directory without a manifest is never read as a store. A store
is built in a staging directory beside its destination and renamed into place
only when complete, so a failed write never leaves a store that looks complete
and never damages the one it would replace.
"""
