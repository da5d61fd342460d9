"""The ``msc`` command line: ``main`` builds the parser; ``sim``, ``bound`` and
``run`` register their commands; ``pictures`` draws what the commands plot."""
