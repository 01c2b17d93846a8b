from minillm.commands import main

main()
