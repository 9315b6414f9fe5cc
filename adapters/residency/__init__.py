"""Where an adapter's weights are: cache levels (object store -> disk -> host RAM), the device pool and its layout,
and the one map of name -> version -> device location."""
