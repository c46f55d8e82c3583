/* The pod sandbox's process, as Kubernetes' own pause image runs it (build/pause/linux/pause.c):
 * PID 1 of the pod's namespaces, it holds them while the containers come and go, reaps the
 * zombies they leave (PID 1's duty), and exits on SIGINT or SIGTERM. Built static here
 * (gcc -static) because no image registry is reachable to pull registry.k8s.io/pause. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int signo) { _exit(0); }

static void on_child(int signo) {
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction stop = {.sa_handler = on_stop};
    struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
    if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
        sigaction(SIGCHLD, &child, NULL) < 0) {
        return 1;
    }
    for (;;) {
        pause();
    }
}
