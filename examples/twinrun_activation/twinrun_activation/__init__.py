"""A twinrun plugin: the `activation` measurement kind and the `scale_sigma_cond` intervention."""
