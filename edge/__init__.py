"""Client-server drafting (as in the Mixture of Attentions paper's client-server setting): the draft runs on
a client device, the target on a server, and only draft trees, verification results and the activations
the draft needs cross the network, in a compact binary encoding (``protocol``). The client keeps
generating from its draft when the server is unreachable and has that text verified when it returns."""
