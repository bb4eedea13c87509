"""Where a request goes. Three wings (docs/routing.md, "The routing app in wings"): ``decision``
(which target serves it: pure), ``proxy`` (the hot path), ``feeds`` (what keeps the decision's
state true); Django's own files, the composition (``process``) and the process's live fleet at the
root."""
