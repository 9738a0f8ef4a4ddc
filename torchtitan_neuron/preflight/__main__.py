from torchtitan_neuron.preflight.checks import main

main()
