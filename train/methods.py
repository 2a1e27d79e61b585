"""The feature-draft methods ``train/heads.py`` trains (a light module: the CLI's ``--help`` lists them without
loading torch). Mixture of Attentions has its own trainer (``train/moa.py``)."""

METHODS = ("eagle", "hass", "griffin", "medusa")
